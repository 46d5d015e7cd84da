"""`flashpass.export` on artifacts exported over 8 devices.

A batch- or head-sharded attention program, exported with ``jax.jit``'s
in/out shardings (on Auto mesh axes with a sharding constraint inside, or on
Explicit axes, where JAX exports the constraints its types imply), is rewritten by the
lift route: the result keeps the artifact's HloShardings and the constraint,
and, called on the same 8 devices, equals the unsharded original forward and
backward (``vjp_order=1``) with the sharded original's output and gradient
shardings and no added collective.  Forms lift does not reproduce are kept
with their reason.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from sharded_testing import P, assert_like_original, mesh, normal, put, run, unsharded

import flashpass.export as fx
from flashpass import compat
from flashpass.kernels.blockwise import BlockwiseKernel

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices (see conftest)")

KERNEL = BlockwiseKernel(block_q=32, block_k=32)
SHAPE = (4, 64, 8, 16)  # [B, T, H, D]


def mha(q, k, v):
    s = jnp.einsum("bthd,bshd->bhts", q, k) / np.sqrt(q.shape[-1])
    return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, axis=-1), v)


#: name -> (mesh shape, axis names, q/k/v and output spec, Explicit axes)
CASES = {
    "batch": ((4, 2), ("data", "rest"), P("data"), False),
    "heads": ((8,), ("model",), P(None, None, "model"), False),
    "batch_heads": ((2, 4), ("data", "model"), P("data", None, "model"), False),
    "explicit_batch_heads": ((4, 2), ("data", "model"), P("data", None, "model"), True),
}


def _exported(mesh_, spec, explicit=False):
    sharding = jax.sharding.NamedSharding(mesh_, spec)

    def program(q, k, v):
        out = mha(q, k, v)
        return out if explicit else jax.lax.with_sharding_constraint(out, sharding)

    structs = [jax.ShapeDtypeStruct(SHAPE, jnp.float32, sharding=sharding)] * 3
    out_shardings = None if explicit else sharding  # Explicit: the output's type has it
    exp = jax.export.export(jax.jit(program, out_shardings=out_shardings))(*structs)
    return jax.export.deserialize(exp.serialize(vjp_order=1))


@pytest.mark.parametrize("case", CASES)
def test_sharded_artifact_is_rewritten_with_its_shardings(case):
    shape, names, spec, explicit = CASES[case]
    mesh_ = mesh(shape, names, explicit=explicit)
    exp = _exported(mesh_, spec, explicit)
    new, report = fx.rewrite_and_explain(exp, kernel=KERNEL)
    assert report.route == "lift" and len(report.rewrites) == 1, str(report)
    new = jax.export.deserialize(new.serialize(vjp_order=1))

    assert new.nr_devices == exp.nr_devices == 8
    assert new.in_shardings_hlo == exp.in_shardings_hlo  # None on JAX 0.12
    assert new.out_shardings_hlo == exp.out_shardings_hlo
    hlo = compat.exported_hlo_shardings(new)
    assert hlo == compat.exported_hlo_shardings(exp)
    assert all(h is not None for h in hlo[0] + hlo[1])
    assert "sdy.sharding_constraint" in new.mlir_module()
    assert "sdy.sharding_constraint" in exp.mlir_module()

    args = [put(mesh_, spec, normal(i, SHAPE)) for i in range(3)]
    assert_like_original(run(new.call, args), run(exp.call, args), run(mha, unsharded(args)))


def test_the_rewritten_artifact_holds_the_kernel():
    """The comparison above can fail: the rewrite's program is not the original's."""
    shape, names, spec, _ = CASES["batch_heads"]
    exp = _exported(mesh(shape, names, explicit=False), spec)
    new = fx.rewrite(exp, kernel=KERNEL)
    # The kernel's function by name: locations hold file paths, which may
    # themselves contain "flashpass" (a checkout in a folder of that name).
    assert "@flashpass_" in new.mlir_module() and "@flashpass_" not in exp.mlir_module()


def test_mixed_mesh_axis_types_are_kept_with_the_reason():
    types = (jax.sharding.AxisType.Explicit, jax.sharding.AxisType.Auto)
    mesh_ = jax.make_mesh((4, 2), ("data", "rest"), types, devices=jax.devices()[:8])
    sharding = jax.sharding.NamedSharding(mesh_, P("data"))
    structs = [jax.ShapeDtypeStruct(SHAPE, jnp.float32, sharding=sharding)] * 3
    exp = jax.export.export(jax.jit(mha))(*structs)
    new, report = fx.rewrite_and_explain(exp, kernel=KERNEL)
    assert new is exp
    assert report.route == "kept" and "all-Auto or all-Explicit" in report.kept_reason, str(report)


def test_shard_map_inside_is_kept_with_the_reason():
    mesh_ = mesh((4, 2), ("data", "rest"), explicit=False)
    sharding = jax.sharding.NamedSharding(mesh_, P("data"))
    inner = jax.shard_map(mha, mesh=mesh_, in_specs=P("data"), out_specs=P("data"))
    structs = [jax.ShapeDtypeStruct(SHAPE, jnp.float32, sharding=sharding)] * 3
    exp = jax.export.export(jax.jit(inner))(*structs)
    assert "sdy.manual_computation" in exp.mlir_module()
    new, report = fx.rewrite_and_explain(exp, kernel=KERNEL)
    assert new is exp
    assert report.route == "kept" and "sdy.manual_computation" in report.kept_reason, str(report)
