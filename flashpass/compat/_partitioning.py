"""Placement decided by XLA's SPMD partitioner: `jax.experimental.custom_partitioning`
(see compat/__init__.py).

A call wrapped by `partitioned` is one custom call in the compiled program;
when XLA has chosen its operands' shardings it asks ``partition`` how to run
it per device.  JAX 0.9 to 0.12 share this API; what differs is the
propagation: with Shardy (the default since JAX 0.7) XLA reads the einsum-like
``rule``, with GSPMD (``jax_use_shardy_partitioner=False``) it calls
``infer``.  Both are always given, so either partitioner works.
"""

from __future__ import annotations

import jax


def partitioned(fn, *, partition, infer, rule: str):
    """``fn(*arrays) -> tuple of arrays`` as a call whose placement XLA decides.

    ``partition(mesh, arg_shardings) -> (lower, arg_shardings, result_shardings)``
    is called at partitioning time with the mesh and the `NamedSharding` XLA
    chose for each argument; it returns the per-device function ``lower``
    (traced with the mesh's axis names bound, so it may use collectives over
    them) and the shardings it wants the arguments in (XLA reshards them to
    these) and gives the results.  ``infer(mesh, arg_shardings) ->
    result_shardings`` is GSPMD's propagation; ``rule`` Shardy's (factors,
    e.g. ``"b t h d, b s h d -> b t h d"``).  On one device ``fn`` runs as is.
    """
    from jax.experimental import custom_partitioning as cp

    call = cp.custom_partitioning(jax.jit(fn))  # (a jit: its constants stay inside)

    def _partition(mesh, arg_shapes, result_shape):
        lower, args, results = partition(mesh, [s.sharding for s in arg_shapes])
        return mesh, lower, tuple(results), tuple(args)

    def _infer(mesh, arg_shapes, result_shape):
        return tuple(infer(mesh, [s.sharding for s in arg_shapes]))

    call.def_partition(_partition, infer_sharding_from_operands=_infer, sharding_rule=rule)
    return call


def shardy_enabled() -> bool:
    """Whether XLA propagates shardings with Shardy (else GSPMD)."""
    return bool(jax.config.jax_use_shardy_partitioner)
