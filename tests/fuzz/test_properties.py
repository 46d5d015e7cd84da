"""Property-based differential tests of the pass (hypothesis).

Generated programs (see attention_programs.py) are optimized and checked:

* true attention sites are rewritten — exactly the expected number, with no
  fallback — and the rewritten program computes what the original computes
  (``kernel="reference"`` isolates the matcher's canonicalisation; the
  ``blockwise`` kernel, with tiny tiles so masking, padding and causal tile
  skipping all run, checks a real kernel);
* near misses are never rewritten (the program is returned untouched);
* lookalikes (still attention) are either left alone or rewritten exactly, and
  a mask that is not causal never becomes a `Causal` op.

The bulk compares the two jaxprs with a NumPy interpreter (numpy_eval.py: an
XLA compilation per example would cost ~1 s on CPU); `test_compiled_sample`
runs the optimized function itself, compiled, with gradients, on a sample.

On failure hypothesis prints the program's source (``note``) — a standalone
reproducer is ``program.reproducer()``.  Known gaps are kept out of the main
generators and pinned by strict xfails (KNOWN_GAPS, test_known_gaps.py);
regions that once held a bug have a property of their own (REGIONS).
"""

import dataclasses

import attention_programs as ap
import jax
import jax.numpy as jnp
import no_silent
import numpy as np
import numpy_eval
from hypothesis import given, note, settings
from hypothesis import strategies as st

import flashpass
from flashpass.kernels.blockwise import BlockwiseKernel


def examples(weight: float) -> settings:
    """This test's share of the active profile's examples."""
    return settings(max_examples=max(1, int(settings.default.max_examples * weight)))


#: Real-kernel instances, created once so probe caches are shared across examples:
#: the default tiles (one tile here) and tiny tiles (several query and key tiles,
#: padded keys, causal tiles skipped).
BLOCKWISE = ("blockwise", BlockwiseKernel(block_q=2, block_k=2), BlockwiseKernel(3, 2))


def _kernel_name(kernel) -> str:
    return kernel if isinstance(kernel, str) else repr(kernel)


def _optimized(program, kernel="reference"):
    fn, args = program.build(seed=0)
    note(program.source())
    opt = flashpass.optimize(fn, kernel=kernel)
    with no_silent.min_len(min(min(site.t, site.s) for site in program.sites)):
        report = opt.explain(*args)
        no_silent.assert_no_silent_miss(opt, report, *args)
    return fn, args, opt, report


def _assert_rewrite_exact(program, args, opt, report) -> None:
    leaves = jax.tree_util.tree_leaves(args)
    original = numpy_eval.evaluate(opt.original_jaxpr(*args), *leaves)
    rewritten = numpy_eval.evaluate(opt.rewritten_jaxpr(*args), *leaves)
    ap.assert_same(rewritten, original, ap.tolerance(program), context=str(report))


def _assert_untouched(opt, args, report) -> None:
    assert not report.rewrites, str(report)
    assert opt.rewritten_jaxpr(*args) is opt.original_jaxpr(*args), str(report)


def _assert_causal_is_sound(program, report) -> None:
    """A `Causal` op only where the program has a causal mask."""
    for site_ops in ap.score_ops(report):
        if "causal" in site_ops:
            assert any(ap.has_causal_mask(s) for s in program.sites), str(report)


# --------------------------------------------------------------------------- properties


@examples(2.5)
@given(program=ap.programs("positive"))
def test_true_sites_are_rewritten_exactly(program):
    _, args, opt, report = _optimized(program)
    assert len(report.rewrites) == program.expected_rewrites, str(report)
    assert not report.fallbacks, str(report)
    assert all(r.kernel == "reference" for r in report.rewrites)
    _assert_causal_is_sound(program, report)
    _assert_rewrite_exact(program, args, opt, report)


@examples(1.5)
@given(program=ap.programs("near_miss"))
def test_near_misses_are_never_rewritten(program):
    _, args, opt, report = _optimized(program)
    _assert_untouched(opt, args, report)


@examples(0.6)
@given(program=ap.programs("mixed"))
def test_a_near_miss_does_not_disturb_a_true_site(program):
    _, args, opt, report = _optimized(program)
    assert len(report.rewrites) == 1, str(report)
    _assert_rewrite_exact(program, args, opt, report)


@examples(0.8)
@given(program=ap.programs("lookalike"))
def test_lookalikes_are_left_alone_or_rewritten_exactly(program):
    _, args, opt, report = _optimized(program)
    (site,) = program.sites
    if site.mutation in ap.NOT_CAUSAL:
        assert not any("causal" in ops for ops in ap.score_ops(report)), str(report)
    if report.rewrites:
        _assert_rewrite_exact(program, args, opt, report)
    else:
        _assert_untouched(opt, args, report)


@examples(0.8)
@given(
    program=st.one_of(ap.programs("positive", single=True), ap.programs("lookalike")),
    kernel=st.sampled_from(BLOCKWISE),
)
def test_blockwise_kernel_computes_the_original(program, kernel):
    _, args, opt, report = _optimized(program, kernel)
    note(f"kernel={_kernel_name(kernel)}")
    if program.expected_rewrites is not None:
        assert len(report.rewrites) == program.expected_rewrites, str(report)
    _assert_causal_is_sound(program, report)
    if report.rewrites:
        _assert_rewrite_exact(program, args, opt, report)


@examples(0.1)
@given(
    program=ap.programs("positive", single=True),
    kernel=st.sampled_from(("reference", BLOCKWISE[1])),
)
def test_compiled_sample(program, kernel):
    """The real path: ``opt(*args)`` compiled against ``fn(*args)``, and gradients.

    Also checks the NumPy interpreter against JAX on the original program, so
    the bulk of the properties rests on a checked oracle.
    """
    fn, args, opt, report = _optimized(program, kernel)
    assert len(report.rewrites) == 1, str(report)
    tol = ap.tolerance(program)
    reference = jax.jit(fn)(*args)  # one compilation, not one per operation
    ap.assert_same(opt(*args), reference, tol, context=str(report))
    leaves = jax.tree_util.tree_leaves(args)
    interpreted = numpy_eval.evaluate(opt.original_jaxpr(*args), *leaves)
    ap.assert_same([np.asarray(x) for x in interpreted], reference, tol, "numpy_eval vs JAX")
    if program.sites[0].dtype != "float32":
        return
    diff = [i for i, a in enumerate(args) if jnp.issubdtype(a.dtype, jnp.floating) and a.ndim]
    ct = jnp.asarray(np.random.default_rng(1).standard_normal(reference.shape), reference.dtype)

    def loss(f):
        return lambda *a: jnp.sum(f(*a) * ct)

    grads = jax.jit(jax.grad(loss(opt), argnums=diff))(*args)
    expected = jax.jit(jax.grad(loss(fn), argnums=diff))(*args)
    ap.assert_same(grads, expected, 5e-4, context="gradients\n" + str(report))


# --------------------------------------------------------------------------- regions


def _in_region(region: str):
    """Single positive sites moved into one of `attention_programs.REGIONS`."""
    return ap.sites("positive", region=region).map(lambda s: ap.Program((s,), "positive"))


@examples(0.2)
@given(program=_in_region("mask_in_a_call_then_softcap"))
def test_constant_additive_mask_in_a_call_then_softcap(program):
    """A constant additive mask in a call, then a soft-cap.  Reproducer::

    def f(q, k, v):  # q = k = v = jnp.ones((2, 2, 4, 4))
        s = q @ jnp.swapaxes(k, -1, -2)
        s = s + jnp.triu(jnp.full((4, 4), -jnp.inf, jnp.float32), k=1)
        s = 5.0 * jnp.tanh(s / 5.0)
        return jax.nn.softmax(s, -1) @ v

    The soft-cap maps the -inf fill to -5, so the causal mask must be applied
    as a boolean mask whose predicate lives inside the ``triu`` call: the
    rewriter raised KeyError (and the site fell back) until the calls computing
    the values a site reads were inlined too (`AttentionSite.inline_calls`).
    """
    _, args, opt, report = _optimized(program)
    assert len(report.rewrites) == 1 and not report.fallbacks, str(report)
    _assert_rewrite_exact(program, args, opt, report)


def _rewritten_exactly(fn, *args) -> None:
    opt = flashpass.optimize(fn, kernel="reference")
    report = opt.explain(*args)
    assert len(report.rewrites) == 1 and not report.fallbacks, str(report)
    np.testing.assert_allclose(opt(*args), jax.jit(fn)(*args), rtol=1e-5, atol=1e-6)


def test_values_read_from_inside_a_call():
    """The BUG1 family: a mask factor or bias the kernel reads is an internal
    value of a helper ``jit`` (not one of its outputs)."""
    rng = np.random.default_rng(0)
    q, k, v, bias = (jnp.asarray(rng.standard_normal((2, 2, 4, 4)), jnp.float32) for _ in "qkvb")

    def softcapped(q, k, v):
        s = q @ jnp.swapaxes(k, -1, -2)
        s = s + jnp.triu(jnp.full((4, 4), -jnp.inf, jnp.float32), k=1)
        s = 5.0 * jnp.tanh(s / 5.0)
        return jax.nn.softmax(s, -1) @ v

    @jax.jit
    def combine(lengths):
        keep = jnp.arange(4)[None, :] < lengths[:, None]  # a padding factor, inside the call
        return jnp.tril(jnp.ones((4, 4), bool))[None, None] & keep[:, None, None, :]

    def padded(q, k, v, lengths, bias):
        s = q @ jnp.swapaxes(k, -1, -2) + jax.jit(lambda b: b * 2.0)(bias)
        return jax.nn.softmax(jnp.where(combine(lengths), s, -1e9), -1) @ v

    _rewritten_exactly(softcapped, q, k, v)
    _rewritten_exactly(padded, q, k, v, jnp.asarray([2, 4]), bias)


@examples(0.2)
@given(program=_in_region("unstabilised_softmax_out_of_range"))
def test_unstabilised_softmax_is_rewritten_to_the_stable_softmax(program):
    """The behaviour is documented in docs/patterns.md.

    ``exp(s) / sum(exp(s))`` is rewritten like ``exp(s - max) / sum``: where
    the scores stay in exp's range the two agree (the main properties draw
    such programs), beyond it the original overflows (NaN) and the rewrite
    computes the stable softmax.  Here the scores are scaled by 100.
    """
    _, args, opt, report = _optimized(program)
    assert len(report.rewrites) == 1 and not report.fallbacks, str(report)
    (site,) = program.sites
    stable = ap.Program((dataclasses.replace(site, softmax="stable"),), "positive")
    stable_fn, stable_args = stable.build(seed=0)
    leaves = jax.tree_util.tree_leaves(args)
    for a, b in zip(leaves, jax.tree_util.tree_leaves(stable_args), strict=True):
        np.testing.assert_array_equal(a, b)  # the same arguments
    rewritten = numpy_eval.evaluate(opt.rewritten_jaxpr(*args), *leaves)
    expected = numpy_eval.evaluate(jax.make_jaxpr(stable_fn)(*stable_args), *leaves)
    ap.assert_same(rewritten, expected, ap.tolerance(program), context=str(report))


def test_unstabilised_softmax_overflow():
    """The documented difference, in the smallest program that shows it."""

    def f(q, k, v):
        e = jnp.exp(q @ jnp.swapaxes(k, -1, -2))  # scores 100: exp overflows
        return (e / e.sum(-1, keepdims=True)) @ v

    q = k = v = jnp.full((2, 2, 2, 4), 5.0, jnp.float32)
    assert np.isnan(np.asarray(f(q, k, v))).all()  # inf / inf
    out = flashpass.optimize(f, kernel="reference")(q, k, v)
    np.testing.assert_allclose(out, jax.nn.softmax(q @ jnp.swapaxes(k, -1, -2), -1) @ v)
    np.testing.assert_allclose(out, 5.0)
