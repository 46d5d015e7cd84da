"""The "no T x S array" check shared by the tests that claim it.

An attention of ``T`` queries over ``S`` keys materialises its scores when
some array holds at least ``T * S`` elements and has two axes of at least
``min(T, S)``, in whatever layout: ``[B, H, T, S]``, ``[B, T, H, S]``, ``[S,
T]``, a ``[B * H * T, S]`` flattening, a stacked ``[L, B, H, T, S]`` residual.
q, k and v (``[B, H, T, D]`` with ``D`` below the sequence length) do not
qualify; test shapes must keep them out (``D < min(T, S)`` and ``B * H * D <
S``), which `assert_no_t_by_s` checks through its positive control.  A 1-D
buffer of ``T * S`` elements escapes the rule: XLA keeps a score matrix 2-D.
The rule reads shapes, not provenance, so any other array with two axes of
at least ``min(T, S)`` counts too: a model's MLP activations ``[B, T, F]``
(a fused gate-and-up projection is ``2 * intermediate`` wide, a mixture of
experts' ``[B * T * top_k, F, W]`` gathered weights) need ``F < min(T, S)``.
"""

from __future__ import annotations

import math

from flashpass import compat
from flashpass.printer import KERNEL_PREFIX


def is_t_by_s(shape, t: int, s: int, copies: int = 1) -> bool:
    """Whether an array of ``shape`` is big enough, and long enough along two
    axes, to hold ``copies`` ``T x S`` score (or probability) matrices."""
    shape = tuple(int(d) for d in shape)
    short = min(t, s)
    return math.prod(shape) >= copies * t * s and sum(d >= short for d in shape) >= 2


def t_by_s_shapes(shapes, t: int, s: int, copies: int = 1) -> list[tuple[int, ...]]:
    """The shapes among ``shapes`` that could hold ``copies`` ``T x S`` matrices."""
    return sorted({tuple(x) for x in shapes if is_t_by_s(x, t, s, copies)})


def jaxpr_shapes(jaxpr, outside_kernels: bool = False) -> list[tuple[int, ...]]:
    """The shape of every input, constant and equation output of ``jaxpr`` (a
    Jaxpr or ClosedJaxpr) and, recursively, of its sub-jaxprs (scan, cond,
    custom derivative, pjit bodies).  ``outside_kernels``: not inside a
    flashpass kernel call (whose one tile may span a short sequence); its
    outputs and residuals still count."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    shapes = [tuple(getattr(v.aval, "shape", ())) for v in (*jaxpr.invars, *jaxpr.constvars)]
    for eqn in jaxpr.eqns:
        shapes += [tuple(getattr(v.aval, "shape", ())) for v in eqn.outvars]
        name = eqn.params.get("name")
        if outside_kernels and isinstance(name, str) and name.startswith(KERNEL_PREFIX):
            continue
        for sub in compat.subjaxprs_of_params(eqn.params):
            shapes += jaxpr_shapes(sub, outside_kernels)
    return shapes


def kernel_operand_shapes(jaxpr, constants: bool = True, qkv: bool = True) -> list[tuple[int, ...]]:
    """The shapes of every flashpass kernel call's operands in a rewritten
    jaxpr (recursively) and, with ``constants``, of its captured constants.
    Without ``qkv``: the extras only (a kernel call reads ``q, k, v, *extras``),
    for programs whose head dimension is not below the sequence lengths."""
    jaxpr, _ = compat.closed_parts(jaxpr)
    shapes = [tuple(v.aval.shape) for v in jaxpr.constvars] if constants else []
    for eqn in jaxpr.eqns:
        name = eqn.params.get("name")
        if isinstance(name, str) and name.startswith("flashpass_"):
            shapes += [tuple(v.aval.shape) for v in eqn.invars[0 if qkv else 3 :]]
            continue
        for sub in compat.subjaxprs_of_params(eqn.params):
            shapes += kernel_operand_shapes(sub, constants, qkv)
    return shapes


def assert_no_t_by_s(shapes, t: int, s: int, *, copies: int = 1, control=None):
    """No array of ``shapes`` could hold ``copies`` ``T x S`` matrices (e.g.
    one per layer, batch row and head: a residual stacked over layers, where a
    kernel's single tile may legitimately span a short sequence).  ``control``:
    the shapes of a program that does materialise them (the original), which
    must be caught, so the check is known to see the layout."""
    shapes = list(shapes)
    assert shapes, "no shapes to check"
    if control is not None:
        found = t_by_s_shapes(control, t, s, copies)
        assert found, f"the control program has no array of {copies} {t} x {s} matrices"
    bad = t_by_s_shapes(shapes, t, s, copies)
    assert not bad, f"arrays that could hold {copies} {t} x {s} matrices: {bad}"


def optimized_step(fn, args, argnums=(0, 1, 2)):
    """A ``value_and_grad`` step of ``sum(fn(*args) ** 2)``, optimized and
    first called under ``jax.jit``: its value and gradients must equal JAX's.
    Returns ``(report, shapes outside the kernels of the rewritten step,
    shapes of the original step)`` for `assert_no_t_by_s`."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import flashpass

    step = jax.value_and_grad(lambda *a: jnp.sum(fn(*a) ** 2), argnums=argnums)
    opt = flashpass.optimize(step, kernel="blockwise")
    value, grads = jax.jit(opt)(*args)
    want_value, want = step(*args)
    np.testing.assert_allclose(value, want_value, rtol=2e-5)
    for g, w in zip(grads, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)
    original = jaxpr_shapes(jax.make_jaxpr(step)(*args))
    rewritten = jaxpr_shapes(opt.rewritten_jaxpr(*args), outside_kernels=True)
    return opt.reports[-1], rewritten, original
