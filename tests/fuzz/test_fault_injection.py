"""Fault injection: a kernel that fails must cost only its own site.

tests/test_api.py::test_failing_kernel_falls_back covers a kernel that raises
while tracing, or returns the wrong shape or dtype, for *every* site.  Here the
kernel fails for one site of two (selected by the key length), in more ways —
at lowering only (an unlowerable primitive, a platform-specific branch),
returning a pytree, a failing ``check`` — and the test checks that:

* the failing site falls back, with the kernel's error in the report;
* the other site is still rewritten by the same kernel;
* the optimized function computes the original (compiled, and its gradient);
* a kernel order ``[broken, "reference"]`` hands the failing site to the next.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.extend.core import Primitive

import flashpass
from flashpass.kernels import Kernel, register_kernel, unregister_kernel
from flashpass.kernels.reference import reference_attention

#: Key length of the site the kernel fails on (the other site has 4).
FAILING_KV_LEN = 6

_no_lowering_p = Primitive("flashpass_test_no_lowering")
_no_lowering_p.def_abstract_eval(lambda x: jax.core.ShapedArray(x.shape, x.dtype))


class _FailsForOneSite(Kernel):
    """A working kernel that fails in ``mode`` for sites with kv_len == FAILING_KV_LEN."""

    platforms = ("cpu", "gpu", "tpu")

    def __init__(self, mode: str):
        self.name = f"fails_{mode}"
        self.mode = mode

    def check(self, spec, ctx):
        if self.mode == "check" and spec.kv_len == FAILING_KV_LEN:
            raise RuntimeError("injected check failure")
        return self.platform_reasons(ctx)

    def apply(self, spec, q, k, v, extras=(), *, interpret=False):
        out = reference_attention(spec, q, k, v, extras)
        if spec.kv_len != FAILING_KV_LEN:
            return out
        if self.mode == "trace":
            raise RuntimeError("injected trace failure")
        if self.mode == "lowering_primitive":  # traces fine, has no lowering rule
            return _no_lowering_p.bind(out)
        if self.mode == "lowering_platform":  # traces fine, has no CPU branch
            return lax.platform_dependent(out, tpu=lambda x: x * 1)
        if self.mode == "shape":
            return out[..., :1]
        if self.mode == "dtype":
            return out.astype(jnp.float16)
        if self.mode == "pytree":
            return out, out
        raise AssertionError(self.mode)


#: mode -> a fragment of the rejection reason the report must carry.
MODES = {
    "trace": "injected trace failure",
    "lowering_primitive": "flashpass_test_no_lowering",
    "lowering_platform": "platform",
    "shape": "expected",
    "dtype": "float16",
    "pytree": "raised",
    "check": "injected check failure",
}


@pytest.fixture(scope="module")
def injected():
    kernels = {mode: register_kernel(_FailsForOneSite(mode)) for mode in MODES}
    yield kernels
    for kernel in kernels.values():
        unregister_kernel(kernel.name)


def _attention(q, k, v):
    s = jnp.einsum("bhtd,bhsd->bhts", q, k) * 0.5
    return jnp.einsum("bhts,bhsd->bhtd", jax.nn.softmax(s, axis=-1), v)


def two_sites(q, k, v, k2, v2):
    """Two sites: keys of length 4 (the kernel works) and 6 (it fails)."""
    return _attention(q, k, v) + _attention(q, k2, v2)


def _args():
    rng = np.random.default_rng(0)
    shapes = [(2, 2, 3, 4), (2, 2, 4, 4), (2, 2, 4, 4), (2, 2, 6, 4), (2, 2, 6, 4)]
    return tuple(jnp.asarray(rng.standard_normal(s), jnp.float32) for s in shapes)


def _close(a, b, tol=2e-5):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_a_failing_site_falls_back_alone(mode, injected):
    args = _args()
    kernel = injected[mode].name
    opt = flashpass.optimize(two_sites, kernel=kernel)
    report = opt.explain(*args)

    assert [r.kernel for r in report.rewrites] == [kernel], str(report)
    assert report.rewrites[0].k_shape[2] == 4
    (fallback,) = report.fallbacks
    assert fallback.rejections, str(report)
    reason = " ".join(fallback.rejections[kernel])
    assert MODES[mode] in reason, str(report)
    assert fallback.reason and fallback.location, str(report)
    assert "kept as written" in str(report) and MODES[mode] in str(report)

    _close(opt(*args), two_sites(*args))
    grad = jax.grad(lambda *a: opt(*a).sum(), argnums=(0, 1, 3))(*args)
    grad_ref = jax.grad(lambda *a: two_sites(*a).sum(), argnums=(0, 1, 3))(*args)
    for a, b in zip(grad, grad_ref, strict=True):
        _close(a, b, 1e-4)


@pytest.mark.parametrize("mode", ["trace", "lowering_primitive", "shape"])
def test_the_next_kernel_takes_the_failing_site(mode, injected):
    args = _args()
    opt = flashpass.optimize(two_sites, kernel=[injected[mode].name, "reference"])
    report = opt.explain(*args)
    assert sorted(report.kernels) == sorted([injected[mode].name, "reference"]), str(report)
    assert not report.fallbacks, str(report)
    _close(opt(*args), two_sites(*args))


def test_a_failure_is_not_cached_across_kernels(injected):
    """The probe cache is per kernel: a failure of one kernel for a spec does not
    make another kernel (or the same spec under another name) fall back."""
    args = _args()
    failing = flashpass.optimize(two_sites, kernel=injected["trace"].name)
    assert len(failing.explain(*args).fallbacks) == 1
    working = flashpass.optimize(two_sites, kernel="reference")
    report = working.explain(*args)
    assert len(report.rewrites) == 2 and not report.fallbacks, str(report)


def test_failures_inside_a_scan_body_fall_back(injected):
    """The same injected failure for a site inside a ``scan`` body."""

    def layers(q, k, v, k2, v2):
        def body(x, _):
            return two_sites(x, k, v, k2, v2), None

        return lax.scan(body, q, None, length=2)[0]

    args = _args()
    opt = flashpass.optimize(layers, kernel=injected["lowering_primitive"].name)
    report = opt.explain(*args)
    assert len(report.rewrites) == 1 and len(report.fallbacks) == 1, str(report)
    assert "scan body" in report.rewrites[0].scope
    _close(opt(*args), layers(*args))
