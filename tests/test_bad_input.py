"""Bad API input fails early, as a TypeError/ValueError that says how to fix it.

Complements tests/test_api.py::test_bad_inputs (non-callable, unknown kernel
name, unknown option, bad platform, cache_size=0, unknown static_argnames,
static_argnums out of range) and ::test_non_array_leaf_and_unhashable_static.
Every error here is raised by flashpass itself — the innermost frame of the
traceback is flashpass code, never JAX internals.
"""

import traceback

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashpass
from flashpass.kernels import kernel_names
from flashpass.kernels.blockwise import BlockwiseKernel

import spellings


def attention(q, k, v):
    return spellings.matmul_bnth(q, k, v)


def with_heads(q, k, v, n_heads):
    return spellings.matmul_bnth(q, k, v) * n_heads


@pytest.fixture
def qkv(rng):
    return spellings.bnth(rng)


def _raised_by_flashpass(excinfo) -> None:
    frames = traceback.extract_tb(excinfo.tb)
    innermost = frames[-1].filename.replace("\\", "/")
    assert "/jax/" not in innermost and "/jaxlib/" not in innermost, (
        f"raised inside JAX ({innermost}:{frames[-1].lineno}): {excinfo.value}"
    )


def _fails(exc_type, match, fn, *args, **kwargs):
    with pytest.raises(exc_type, match=match) as excinfo:
        fn(*args, **kwargs)
    _raised_by_flashpass(excinfo)
    return excinfo.value


# ------------------------------------------------------------------ the function


@pytest.mark.parametrize("fn", [42, "attention", [attention], object()])
def test_not_a_callable(fn):
    _fails(TypeError, "expects a callable", flashpass.optimize, fn)
    _fails(TypeError, "expects a callable", flashpass.optimize(kernel="reference"), fn)
    _fails(TypeError, "expects a callable", flashpass.explain, fn)


# ------------------------------------------------------------------ kernel=


def test_unknown_kernel_names_list_the_known_ones():
    for kernel in ("flash", ["reference", "flash"], ""):
        error = _fails(
            ValueError, "unknown flashpass kernel", flashpass.optimize, attention, kernel=kernel
        )
        assert all(name in str(error) for name in kernel_names())


@pytest.mark.parametrize(
    "kernel", [42, object(), BlockwiseKernel, [42], ("reference", 3), {"reference"}]
)
def test_kernel_of_the_wrong_type(kernel):
    error = _fails(
        TypeError, "kernel name, a Kernel instance", flashpass.optimize, attention, kernel=kernel
    )
    assert "reference" in str(error)  # the known names


def test_empty_kernel_list_turns_the_pass_off():
    """``kernel=[]`` (no kernel allowed) is the off switch for one function."""
    q = jnp.ones((1, 128, 2, 8))
    opt = flashpass.optimize(attention, kernel=[])
    report = opt.explain(q, q, q)
    assert report.disabled == "kernel=[]" and not report.rewrites, report
    assert "disabled (kernel=[])" in str(report)
    np.testing.assert_allclose(opt(q, q, q), attention(q, q, q), rtol=1e-6)


# ------------------------------------------------------------------ platform= and options


@pytest.mark.parametrize("platform", ["GPU", "vax", "", 1])
def test_bad_platform(platform):
    error = _fails(
        ValueError, "platform must be one of", flashpass.optimize, attention, platform=platform
    )
    assert "'cpu', 'gpu', 'tpu'" in str(error)


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_interpret_must_be_a_bool(value):
    _fails(
        TypeError, "interpret must be True or False", flashpass.optimize, attention, interpret=value
    )


@pytest.mark.parametrize("value", [-1, 2.0, True, "8", None])
def test_bad_cache_size(value):
    _fails(
        ValueError,
        "cache_size must be a positive int",
        flashpass.optimize,
        attention,
        cache_size=value,
    )


@pytest.mark.parametrize("option", ["kernels", "cachesize", "static_args", "donate_argnums"])
def test_unknown_options_are_named(option):
    error = _fails(
        TypeError, "unknown flashpass.optimize option", flashpass.optimize, attention, **{option: 1}
    )
    assert option in str(error) and "cache_size" in str(error)


# ------------------------------------------------------------------ static arguments


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({"static_argnums": "3"}, TypeError, "static_argnums must be ints"),
        ({"static_argnums": 1.5}, TypeError, "static_argnums must be ints"),
        ({"static_argnums": (3, "n")}, TypeError, "static_argnums must be ints"),
        ({"static_argnums": True}, TypeError, "static_argnums must be ints"),
        ({"static_argnames": 3}, TypeError, "static_argnames strings"),
        ({"static_argnames": ("n_heads", 1)}, TypeError, "static_argnames must be strings"),
        ({"static_argnums": 4}, ValueError, "takes 4 positional arguments"),
        ({"static_argnums": -5}, ValueError, "out of range"),
        ({"static_argnames": "heads"}, ValueError, "parameters: .*n_heads"),
    ],
)
def test_bad_static_argument_specs(kwargs, exc, match):
    _fails(exc, match, flashpass.optimize, with_heads, **kwargs)


def test_negative_static_argnums_need_a_fixed_signature():
    _fails(
        ValueError,
        "fixed number of arguments",
        flashpass.optimize,
        lambda *args: attention(*args[:3]),
        static_argnums=-1,
    )


def test_static_argument_not_passed(qkv):
    opt = flashpass.optimize(with_heads, static_argnums=3)
    _fails(ValueError, "static_argnums=3 but only 3 positional", opt, *qkv)


def test_unhashable_static_arguments_say_how_to_fix(qkv):
    opt = flashpass.optimize(with_heads, static_argnames="n_heads")
    error = _fails(TypeError, "must be hashable", opt, *qkv, np.ones(2))
    assert "non-static" in str(error)
    _fails(TypeError, "must be hashable", opt, *qkv, {"a": 1})


@pytest.mark.parametrize("spec", [{"static_argnames": "n_heads"}, {"static_argnums": 3}])
def test_static_arguments_passed_by_keyword(spec, qkv):
    """A static parameter that has a position may be passed by keyword or
    positionally.  Either form works (as with ``jax.jit``) and both share one
    cache entry; another value is another entry."""
    opt = flashpass.optimize(with_heads, kernel="reference", **spec)
    np.testing.assert_allclose(opt(*qkv, n_heads=3), with_heads(*qkv, 3), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(opt(*qkv, 3), with_heads(*qkv, 3), rtol=1e-5, atol=1e-5)
    assert opt.traces == 1
    np.testing.assert_allclose(opt(*qkv, n_heads=2), with_heads(*qkv, 2), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(opt(*qkv, 2), with_heads(*qkv, 2), rtol=1e-5, atol=1e-5)
    assert opt.traces == 2
    q, k, v = qkv
    np.testing.assert_allclose(opt(q, k, v=v, n_heads=3), with_heads(*qkv, 3), rtol=1e-5, atol=1e-5)
    assert opt.traces == 3  # v by keyword: another argument structure
    assert opt.cache_info()["size"] == 3


def test_static_argument_with_a_default_may_be_omitted(qkv):
    def fn(q, k, v, n_heads=2):
        return with_heads(q, k, v, n_heads)

    opt = flashpass.optimize(fn, kernel="reference", static_argnums=3)
    np.testing.assert_allclose(opt(*qkv), with_heads(*qkv, 2), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(opt(*qkv, 5), with_heads(*qkv, 5), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(opt(*qkv, n_heads=5), with_heads(*qkv, 5), rtol=1e-5, atol=1e-5)
    assert opt.traces == 2


def test_static_argument_passed_twice(qkv):
    opt = flashpass.optimize(with_heads, static_argnames="n_heads")
    _fails(TypeError, "multiple values for argument 'n_heads'", opt, *qkv, 3, n_heads=3)


def test_static_arguments_of_decorated_methods(qkv):
    class Layer:
        def __init__(self, scale):
            self.scale = scale

        @flashpass.optimize(kernel="reference", static_argnums=4)
        def __call__(self, q, k, v, n_heads):
            return with_heads(q, k, v, n_heads) * self.scale

    layer = Layer(0.5)
    expected = with_heads(*qkv, 3) * 0.5
    np.testing.assert_allclose(layer(*qkv, 3), expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(layer(*qkv, n_heads=3), expected, rtol=1e-5, atol=1e-5)
    assert layer.__call__.traces == 1
    _fails(ValueError, "'n_heads' was not passed by keyword", layer, *qkv)


# ------------------------------------------------------------------ argument leaves


@pytest.mark.parametrize(
    "leaf, match",
    [
        ("heads", "is a str"),
        (b"x", "is a bytes"),
        (object(), "is a object"),
        (np.array([object()]), "dtype object"),
        (np.array(["a", "b"]), "dtype <U1"),
        (2**40, "does not fit in int32"),
    ],
)
def test_non_array_leaves_name_the_leaf_and_the_fix(leaf, match, qkv):
    for call in (flashpass.optimize(with_heads), flashpass.optimize(with_heads).explain):
        error = _fails(TypeError, match, call, *qkv, leaf)
        assert "[0][3]" in str(error)  # which leaf: positional argument 3
        assert "static_arg" in str(error)


def test_non_array_leaf_inside_a_pytree(qkv):
    def fn(params, x):
        return attention(params["q"], params["k"], x)

    q, k, v = qkv
    error = _fails(TypeError, "is a str", flashpass.optimize(fn), {"q": q, "k": k, "name": "x"}, v)
    assert "'name'" in str(error)


def test_valid_unusual_leaves_are_accepted(qkv):
    """Not errors: numpy and Python scalars, bool and bfloat16 numpy arrays, None."""
    q, k, v = qkv

    def fn(q, k, v, scale, mask, low, nothing):
        assert nothing is None
        out = attention(q, k, v) * scale
        return out, jnp.where(mask, low.astype(jnp.float32), 0.0)

    opt = flashpass.optimize(fn, kernel="reference")
    low = np.ones(3, dtype=jnp.bfloat16)
    for scale in (2, 2.0, np.float32(2.0), np.int64(2), 1j):
        out, masked = opt(q, k, v, scale, np.array([True, False, True]), low, None)
        assert out.shape == q.shape and masked.dtype == jnp.float32


def test_shape_dtype_structs_are_for_explain_only(qkv):
    """``explain`` traces ``jax.ShapeDtypeStruct``s; a call needs arrays.  The call's
    error comes from ``jax.jit`` (it names the ShapeDtypeStruct argument)."""
    q, k, v = qkv
    struct = jax.ShapeDtypeStruct(q.shape, q.dtype)
    opt = flashpass.optimize(attention, kernel="reference")
    assert len(opt.explain(struct, k, v).rewrites) == 1
    with pytest.raises(TypeError, match="ShapeDtypeStruct"):
        opt(struct, k, v)
