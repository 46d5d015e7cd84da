"""The public API: decorator forms, pytrees, caching, composition, errors, logging."""

import inspect
import json
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashpass
from flashpass.kernels import Kernel, register_kernel, unregister_kernel
from flashpass.kernels.reference import reference_attention

import spellings


def _close(a, b, tol=2e-5):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol)


def test_decorator_forms(rng):
    @flashpass.optimize
    def plain(q, k, v):
        return spellings.matmul_bnth(q, k, v)

    @flashpass.optimize(kernel="reference")
    def named(q, k, v):
        return spellings.matmul_bnth(q, k, v)

    args = spellings.bnth(rng)
    assert isinstance(plain, flashpass.Optimized) and plain.__name__ == "plain"
    _close(plain(*args), spellings.matmul_bnth(*args))
    assert named.explain(*args).rewrites[0].kernel == "reference"


def test_pytrees_kwargs_and_static_args(rng):
    def model(params, x, *, causal, scale=1.0):
        q, k, v = params["q"] * x, params["k"], params["v"]
        s = q @ k.swapaxes(-1, -2) * 0.3
        if causal:
            t = q.shape[2]
            s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -jnp.inf)
        return {"out": jax.nn.softmax(s, -1) @ v * scale, "aux": (x, None)}

    q, k, v = spellings.bnth(rng)
    params = {"q": q, "k": k, "v": v}
    opt = flashpass.optimize(model, kernel="reference", static_argnames="causal")
    out = opt(params, 2.0, causal=True, scale=0.5)
    ref = model(params, 2.0, causal=True, scale=0.5)
    _close(out["out"], ref["out"])
    assert out["aux"][1] is None
    assert opt.explain(params, 2.0, causal=True, scale=0.5).rewrites[0].causal
    assert not opt.explain(params, 2.0, causal=False).rewrites[0].causal


def test_static_argnums(rng):
    def fn(q, k, v, n_heads):
        return spellings.matmul_bnth(q, k, v) * n_heads

    opt = flashpass.optimize(fn, kernel="reference", static_argnums=3)
    args = spellings.bnth(rng)
    _close(opt(*args, 3), fn(*args, 3))
    assert opt.traces == 1
    opt(*args, 4)
    assert opt.traces == 2


def test_cache_reuse_and_bound(rng):
    opt = flashpass.optimize(spellings.matmul_bnth, kernel="reference", cache_size=2)
    args = spellings.bnth(rng)
    opt(*args)
    opt(*args)
    opt.explain(*args)
    assert opt.traces == 1, "a second call with the same signature must not trace again"
    for t in (4, 5, 6):
        opt(*spellings.bnth(rng, t=t, s=t))
    info = opt.cache_info()
    assert info["size"] == 2 and info["traces"] == 4


def test_composes_with_jit_grad_vmap(rng):
    fn = spellings.causal_tril_where
    opt = flashpass.optimize(fn, kernel="reference")
    q, k, v = spellings.btnh(rng)
    _close(jax.jit(opt)(q, k, v), fn(q, k, v))
    val, grads = jax.value_and_grad(lambda q, k: opt(q, k, v).sum(), argnums=(0, 1))(q, k)
    val_r, grads_r = jax.value_and_grad(lambda q, k: fn(q, k, v).sum(), argnums=(0, 1))(q, k)
    _close(val, val_r, 1e-4)
    for a, b in zip(grads, grads_r, strict=True):
        _close(a, b, 1e-4)
    # vmap over an extra leading axis
    qs, ks, vs = (jnp.stack([x, x * 0.5]) for x in (q, k, v))
    _close(jax.vmap(opt)(qs, ks, vs), jax.vmap(fn)(qs, ks, vs))
    _close(
        jax.jit(jax.grad(lambda q: opt(q, k, v).sum()))(q),
        jax.grad(lambda q: fn(q, k, v).sum())(q),
        1e-4,
    )


def test_method_decoration(rng):
    class Layer:
        scale = 0.3

        @flashpass.optimize(kernel="reference")
        def __call__(self, q, k, v):
            return jax.nn.softmax(q @ k.swapaxes(-1, -2) * self.scale, -1) @ v

    args = spellings.bnth(rng)
    layer = Layer()
    _close(layer(*args), jax.nn.softmax(args[0] @ args[1].swapaxes(-1, -2) * 0.3, -1) @ args[2])
    # the bound method is the instance's optimized function: its settings and cache
    method = layer.__call__
    assert method.__self__ is layer and method.__name__ == "__call__"
    assert list(inspect.signature(method).parameters) == ["q", "k", "v"]
    assert flashpass.explain(method, *args).rewrites[0].kernel == "reference"
    assert method.explain(*args).rewrites and method.traces == 1
    _close(jax.jit(method)(*args), layer(*args))


def test_report_is_json_and_readable(rng):
    def fn(q, k, v):
        p = jax.nn.softmax(q @ k.swapaxes(-1, -2), -1)
        return spellings.matmul_bnth(q, k, v), p  # second site returns its weights

    report = flashpass.explain(flashpass.optimize(fn, kernel="reference"), *spellings.bnth(rng))
    data = json.loads(report.to_json())
    assert len(data["rewrites"]) == 1 and len(data["fallbacks"]) == 1
    assert data["rewrites"][0]["q_shape"] == [spellings.B, spellings.H, spellings.T, spellings.D]
    text = str(report)
    assert "1 rewritten, 1 kept as written" in text and "reference" in text
    assert "returned" in text


def test_logging_once_per_signature(rng, caplog):
    opt = flashpass.optimize(spellings.matmul_bnth, kernel="reference")
    args = spellings.bnth(rng)
    with caplog.at_level(logging.INFO, logger="flashpass"):
        opt(*args)
        opt(*args)
    lines = [r.getMessage() for r in caplog.records if r.name == "flashpass"]
    assert len(lines) == 1 and "rewrote attention" in lines[0] and "reference" in lines[0]


def test_explain_logs_nothing_until_the_program_runs(rng, caplog):
    opt = flashpass.optimize(spellings.matmul_bnth, kernel="reference")
    args = spellings.bnth(rng)
    with caplog.at_level(logging.INFO, logger="flashpass"):
        assert opt.explain(*args).rewrites
        assert not [r for r in caplog.records if r.name == "flashpass"]
        jax.jit(opt)(*args)
    lines = [r.getMessage() for r in caplog.records if r.name == "flashpass"]
    assert len(lines) == 1 and "rewrote attention" in lines[0], lines


# ------------------------------------------------------------------ bad input


def test_bad_inputs():
    with pytest.raises(TypeError, match="callable"):
        flashpass.optimize(42)
    with pytest.raises(ValueError, match="known kernels: .*blockwise"):
        flashpass.optimize(spellings.matmul_bnth, kernel="no_such_kernel")
    with pytest.raises(TypeError, match="unknown flashpass.optimize option"):
        flashpass.optimize(spellings.matmul_bnth, cache_sise=3)
    with pytest.raises(ValueError, match="platform"):
        flashpass.optimize(spellings.matmul_bnth, platform="quantum")
    with pytest.raises(ValueError, match="cache_size"):
        flashpass.optimize(spellings.matmul_bnth, cache_size=0)
    with pytest.raises(ValueError, match="static_argnames"):
        flashpass.optimize(spellings.matmul_bnth, static_argnames="nope")
    with pytest.raises(ValueError, match="static_argnums"):
        flashpass.optimize(spellings.matmul_bnth, static_argnums=7)


def test_non_array_leaf_and_unhashable_static(rng):
    def fn(q, k, v, name):
        return spellings.matmul_bnth(q, k, v)

    args = spellings.bnth(rng)
    with pytest.raises(TypeError, match="static_argnums"):
        flashpass.optimize(fn)(*args, "heads")
    with pytest.raises(TypeError, match="hashable"):
        flashpass.optimize(fn, static_argnums=3)(*args, ["not", "hashable"])


# ------------------------------------------------------------------ kernel failures


class _Broken(Kernel):
    platforms = ("cpu", "gpu", "tpu")

    def __init__(self, name, mode):
        self.name = name
        self.mode = mode

    def check(self, spec, ctx):
        return self.platform_reasons(ctx)

    def apply(self, spec, q, k, v, extras=(), *, interpret=False):
        if self.mode == "raise":
            raise RuntimeError("injected failure")
        out = reference_attention(spec, q, k, v, extras)
        if self.mode == "shape":
            return out[..., :1]
        return out.astype(jnp.float16)


@pytest.fixture
def broken_kernels():
    kernels = [register_kernel(_Broken(f"broken_{m}", m)) for m in ("raise", "shape", "dtype")]
    yield kernels
    for k in kernels:
        unregister_kernel(k.name)


@pytest.mark.parametrize("mode", ["raise", "shape", "dtype"])
def test_failing_kernel_falls_back(mode, broken_kernels, rng):
    def two_sites(q, k, v):
        return spellings.matmul_bnth(q, k, v) + spellings.causal_iota_finfo_min(q, k, v)

    args = spellings.bnth(rng)
    opt = flashpass.optimize(two_sites, kernel=f"broken_{mode}")
    report = opt.explain(*args)
    assert not report.rewrites and len(report.fallbacks) == 2
    rejection = report.fallbacks[0].rejections[f"broken_{mode}"][0]
    assert {"raise": "injected failure", "shape": "expected", "dtype": "float16"}[mode] in rejection
    _close(opt(*args), two_sites(*args))
    # the next kernel in the order takes the site
    chained = flashpass.optimize(two_sites, kernel=[f"broken_{mode}", "reference"])
    assert chained.explain(*args).kernels == ["reference", "reference"]
    _close(chained(*args), two_sites(*args))


def test_register_kernel_validation():
    with pytest.raises(TypeError):
        register_kernel(object())
    with pytest.raises(ValueError, match="already registered"):
        register_kernel(_Broken("blockwise", "raise"))
