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
reproducer is ``program.reproducer()``.  Known bugs and gaps are kept out of
the main generators and pinned by strict xfails (KNOWN_BUGS here, KNOWN_GAPS
in test_known_gaps.py).
"""

import attention_programs as ap
import jax
import jax.numpy as jnp
import numpy as np
import numpy_eval
import pytest
from hypothesis import Phase, given, note, settings
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
    return fn, args, opt, opt.explain(*args)


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


# --------------------------------------------------------------------------- known bugs


def _bug(bug_id: str):
    """Strict xfail: the test must keep failing until the bug is fixed.  No
    shrinking (the reproducer is in the docstring) keeps it to a few seconds."""
    description = ap.KNOWN_BUGS[bug_id][0]
    xfail = pytest.mark.xfail(strict=True, reason=f"{bug_id}: {description}")
    quick = settings(max_examples=20, phases=(Phase.explicit, Phase.generate))

    def mark(test):
        return xfail(quick(test))

    return mark


@_bug("BUG1")
@given(program=ap.sites("positive", region="BUG1").map(lambda s: ap.Program((s,), "positive")))
def test_bug1_constant_additive_mask_in_a_call_then_softcap(program):
    """Reproducer::

    def f(q, k, v):  # q = k = v = jnp.ones((2, 2, 4, 4))
        s = q @ jnp.swapaxes(k, -1, -2)
        s = s + jnp.triu(jnp.full((4, 4), -jnp.inf, jnp.float32), k=1)
        s = 5.0 * jnp.tanh(s / 5.0)
        return jax.nn.softmax(s, -1) @ v

    flashpass.optimize(f, kernel="reference")(q, k, v)  # KeyError (rewrite.py read_key)
    """
    _, args, opt, report = _optimized(program)
    assert len(report.rewrites) == 1 and not report.fallbacks, str(report)
    _assert_rewrite_exact(program, args, opt, report)


@_bug("BUG2")
@given(program=ap.sites("positive", region="BUG2").map(lambda s: ap.Program((s,), "positive")))
def test_bug2_unstabilised_softmax_overflow(program):
    """Reproducer::

    def f(q, k, v):  # q = k = v = jnp.full((2, 2, 2, 4), 5.0, jnp.float32)
        e = jnp.exp(q @ jnp.swapaxes(k, -1, -2))  # scores 100: exp overflows
        return (e / e.sum(-1, keepdims=True)) @ v

    f(q, k, v)                                          # NaN (inf / inf)
    flashpass.optimize(f, kernel="reference")(q, k, v)  # 5.0 everywhere
    """
    _, args, opt, report = _optimized(program)
    assert len(report.rewrites) == 1, str(report)
    _assert_rewrite_exact(program, args, opt, report)
