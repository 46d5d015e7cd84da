"""Stage 5 on one device: `flashpass.placement.place` and its result types."""

import ast
import collections
import dataclasses
import pathlib
import typing

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import flashpass
from flashpass import compat, errors, pipeline, sharding
from flashpass.graph import build_scopes
from flashpass.kernels import CheckContext
from flashpass.placement import (
    EMIT,
    PLACED_AT_PARTITIONING,
    BodyRing,
    Context,
    Deferred,
    Kept,
    Local,
    PerShard,
    Placement,
    Ring,
    place,
)
from flashpass.ring import cases as ring_cases
from flashpass.select import resolve_order

import spellings


def _two_sites(q, k, v):
    return spellings.matmul_bnth(q, k, v) + spellings.matmul_bnth(q * 2, k, v)


def _planned(fn, args):
    closed, _ = pipeline.trace(fn, [jax.typeof(a) for a in args])
    scopes = build_scopes(compat.dce_closed_jaxpr(closed))  # as run_pass does
    where_is = collections.defaultdict(lambda: "a body", {(): "top level"})
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
    """Every type of the `Placement` union but `Kept` (nothing is emitted:
    the site stays as written) has its emitter, and is frozen; read from the
    union, so a new type is checked without being listed here."""
    kinds = set(typing.get_args(Placement))
    assert {Local, PerShard, Ring, BodyRing, Deferred, Kept} <= kinds
    assert set(EMIT) == kinds - {Kept}
    for kind in kinds:
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


def test_placements_describe_themselves(rng):
    """The report and the partitioning log read a placement's own words
    (pipeline.py names no placement type)."""
    planned, _, _, ctx = _planned(_two_sites, spellings.bnth(rng))
    p = planned[0]
    shard = sharding.ShardPlan(None, {"T": ("seq",), "S": ("seq",)}, (), (), None, None, ("seq",))
    ring = Ring(shard, steps=((ring_cases.StepCase(why="plain"),),))
    body = BodyRing(p.site, ("seq",), 4)
    deferred = Deferred((), Context(ctx))
    words = [
        (Local(), ("reference", "", "", "as is", "", "")),
        (Local("q only"), ("reference", "", "", "gathered", "q only", "")),
        (PerShard(shard), ("reference", "", "", "per shard", "", "")),
        (PerShard(shard, "d"), ("reference", "", "", "gathered, then per shard", "d", "")),
        (ring, ("ring", ring_cases.PLAIN, "", f"ring over seq ({ring_cases.PLAIN})", "", "")),
        (body, ("ring", ring_cases.PLAIN, "", f"ring over seq ({ring_cases.PLAIN})", "", "")),
        (deferred, ("reference", "", PLACED_AT_PARTITIONING, PLACED_AT_PARTITIONING, "", "")),
        (Kept("why"), ("reference", "", "", "kept as written", "", "why")),
    ]
    for placement, want in words:
        got = (placement.kernel(p), placement.ring_steps, placement.note, placement.how)
        assert got + (placement.why, placement.kept) == want, placement
        assert placement.runs(p) is p  # a forward-only site runs as planned
    source = (pathlib.Path(pipeline.__file__)).read_text()
    names = {n.id for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Name)}
    assert not names & {"Local", "PerShard", "Ring", "BodyRing", "Deferred", "Kept"}


def _attend(q, k, v):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.25
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


def _reshard_step(q, k, v):  # Explicit axes: k and v gathered by the program
    def loss(q, k, v):
        return jnp.sum(_attend(q, jax.sharding.reshard(k, P()), jax.sharding.reshard(v, P())) ** 2)

    return jax.value_and_grad(loss, (0, 1, 2))(q, k, v)


def _body_step(q, k, v):  # in the user's shard_map: k and v all-gathered there
    def loss(q, k, v):
        k, v = (jax.lax.all_gather(x, "seq", axis=1, tiled=True) for x in (k, v))
        return jnp.sum(_attend(q, k, v) ** 2)

    value, grads = jax.value_and_grad(loss, (0, 1, 2))(q, k, v)
    return jax.lax.psum(value, "seq"), grads


@pytest.mark.parametrize("where", ["reshard", "shard_map"])
def test_matching_proves_the_backward_a_ring_runs(rng, where):
    """A train step whose k and v are gathered (by the program's ``reshard`` on
    Explicit axes, or ``all_gather`` in the user's ``shard_map``): stage 3 proves
    the site's backward as written and also reading k and v from before the
    gathers (the gathers join the forward), the form a ring runs
    (`AttentionSite.ungathered`), so stage 5 proves nothing."""
    mesh = jax.make_mesh((1,), ("seq",), axis_types=(jax.sharding.AxisType.Explicit,))
    spec = P(None, "seq")
    args = [jax.device_put(x, NamedSharding(mesh, spec)) for x in spellings.bnth(rng)]
    step = _reshard_step
    if where == "shard_map":
        step = jax.shard_map(_body_step, mesh=mesh, in_specs=spec, out_specs=(P(), (spec,) * 3))
    with jax.set_mesh(mesh):
        planned, scopes, _, _ = _planned(step, args)
    [site] = [p.site for p in planned]
    scope = scopes[site.scope_prefix]
    gathers = [scope.producer(operand.atom) for operand in (site.k, site.v)]
    assert [g.prim for g in gathers] == [{"shard_map": "all_gather"}.get(where, where)] * 2
    ring_form = site.ungathered
    assert site.backward is not None and ring_form is not None and ring_form.backward is not None
    assert [ring_form.k.atom, ring_form.v.atom] == [scope.resolve(g.ins[0]) for g in gathers]
    assert set(gathers) <= ring_form.nodes and not set(gathers) & site.nodes
    assert ring_form.nodes - ring_form.backward.nodes == site.nodes - site.backward.nodes


def test_a_forward_only_site_has_no_ring_form(rng):
    planned, _, _, _ = _planned(_two_sites, spellings.bnth(rng))
    assert [p.site.ungathered for p in planned] == [None, None]
