"""Stage 5 on one device: `flashpass.placement.place` and its result types."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashpass
from flashpass import errors, pipeline, sharding
from flashpass.graph import build_scopes
from flashpass.kernels import CheckContext
from flashpass.placement import EMIT, BodyRing, Deferred, Kept, Local, PerShard, Ring, place
from flashpass.select import resolve_order

import spellings


def _two_sites(q, k, v):
    return spellings.matmul_bnth(q, k, v) + spellings.matmul_bnth(q * 2, k, v)


def _planned(fn, args):
    closed, _ = pipeline.trace(fn, [jax.typeof(a) for a in args])
    scopes = build_scopes(closed)
    where_is = {(): "top level"}
    kernels, _ = resolve_order("reference", "cpu")
    ctx = CheckContext(platform="cpu", explicit=True)
    matched = pipeline.match(scopes, where_is)
    planned, _ = pipeline.choose_kernels(matched.sites, kernels, ctx, False, where_is)
    return planned, {s.prefix: s for s in scopes}, kernels, ctx


def test_unsharded_sites_run_where_they_stand(rng):
    args = spellings.bnth(rng)
    planned, scopes, kernels, ctx = _planned(_two_sites, args)
    placed = place(planned, scopes, kernels, ctx)
    assert [type(p.placement) for p in placed] == [Local, Local]
    assert [p.planned for p in placed] == planned  # nothing re-planned


def test_every_placement_type_has_an_emitter():
    assert set(EMIT) == {Local, PerShard, Ring, BodyRing, Deferred}
    for kind in (Local, PerShard, Ring, BodyRing, Deferred, Kept):
        assert dataclasses.is_dataclass(kind) and kind.__dataclass_params__.frozen


def test_a_site_whose_placement_raises_is_kept_alone(rng, monkeypatch):
    """An internal error while placing one site keeps that site (reported as
    an error of the "plan" stage); the other is still rewritten."""
    args = spellings.bnth(rng)
    planned, scopes, kernels, ctx = _planned(_two_sites, args)
    analyze, broken = sharding.analyze, planned[0].site.root.path

    def flaky(site, *a, **kw):
        if site.root.path == broken:
            raise RuntimeError("placing failed")
        return analyze(site, *a, **kw)

    monkeypatch.setattr(sharding, "analyze", flaky)
    with errors.strict_mode(False):
        placed = place(planned, scopes, kernels, ctx)
    assert placed[0].placement == Kept("RuntimeError: placing failed", internal=True)
    assert isinstance(placed[1].placement, Local)
    with errors.strict_mode(False):
        opt = flashpass.optimize(_two_sites, kernel="reference", strict=False)
        report = opt.explain(*args)
        out = opt(*args)
    assert len(report.rewrites) == 1 and [e.stage for e in report.errors] == ["plan"]
    np.testing.assert_allclose(out, _two_sites(*args), rtol=2e-5, atol=2e-5)
    with pytest.raises(RuntimeError, match="placing failed"), errors.strict_mode(True):
        place(planned, scopes, kernels, ctx)


def test_zigzag_is_an_option():
    with pytest.raises(TypeError, match="zigzag"):
        flashpass.optimize(jnp.sum, zigzag="no")
    assert flashpass.optimize(jnp.sum, zigzag=False)._zigzag is False
