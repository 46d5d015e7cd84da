"""The first call of an optimized function inside a user's ``shard_map``
(``check_vma=True``, JAX's default) keeps its rewrite.

Inside the body every value is typed with the manual axes it varies over, and a
kernel loop whose initial carry is built from constants must be cast to the
type of what it computes from the per-shard q, k and v.  Every rewritten
spelling runs with the blockwise kernel on small tiles (so its forward and
backward loops really loop) in a ``shard_map`` over the batch axis, both as
``jit(shard_map(optimize(f)))`` and ``jit(optimize(shard_map(f)))``; a few
over heads and query rows, with gradients; and every kernel that runs on CPU
in interpret mode once.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from sharded_testing import P, mesh

import flashpass
from flashpass.kernels.blockwise import BlockwiseKernel
from flashpass.kernels.pallas_gpu import PallasGpuKernel
from flashpass.kernels.pallas_tpu import PallasTpuKernel
from flashpass.kernels.splash import SplashKernel

import spellings
from jax_versions import requires_triton

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices (see conftest)")

REWRITTEN = {**spellings.POSITIVE, **{k: v[:2] for k, v in spellings.STRUCTURED.items()}}
TILED = BlockwiseKernel(block_q=4, block_k=4)  # T = S = 16: four tiles each way


def _tol(x):
    return 2e-2 if jnp.dtype(x.dtype) == jnp.bfloat16 else 2e-5


def _close(got, want, scale=1.0):
    tol = _tol(want) * scale
    np.testing.assert_allclose(
        np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol
    )


def _batch_specs(fn, args):
    """``(in_specs, out_spec)``: ``P("x")`` for every argument and the output
    with the batch axis first; replicated where the spelling does not keep
    batch rows apart (one head of one row, a batch of one)."""
    batched = lambda x: np.ndim(x) and x.shape[0] == spellings.B  # noqa: E731
    if not (batched(args[0]) and batched(jax.eval_shape(fn, *args))):
        return (P(),) * len(args), P()
    return tuple(P("x") if batched(a) else P() for a in args), P("x")


def _wrapped(fn, m, in_specs, out_spec, *, optimize_outside, kernel=TILED, interpret=False):
    """``(program, optimized)``: ``fn`` under a ``shard_map`` over ``m``, jitted,
    with `flashpass.optimize` inside the ``shard_map`` or around it."""
    if optimize_outside:
        body = jax.shard_map(fn, mesh=m, in_specs=in_specs, out_specs=out_spec)
        opt = flashpass.optimize(body, kernel=kernel, interpret=interpret)
        return jax.jit(opt), opt
    opt = flashpass.optimize(fn, kernel=kernel, interpret=interpret)
    program = jax.shard_map(opt, mesh=m, in_specs=in_specs, out_specs=out_spec)
    return jax.jit(program), opt


def _assert_rewritten(opt, kernel):
    (report,) = opt.reports
    assert report.kernels == [kernel], str(report)
    assert not report.fallbacks and not report.errors, str(report)


@pytest.mark.parametrize("optimize_outside", [False, True], ids=["inside", "outside"])
@pytest.mark.parametrize("name", sorted(REWRITTEN))
def test_batch_sharded_first_call(name, optimize_outside):
    fn, make = REWRITTEN[name]
    args = make(np.random.default_rng(0))
    m = mesh((2,), ("x",), explicit=False)
    in_specs, out_spec = _batch_specs(fn, args)
    program, opt = _wrapped(fn, m, in_specs, out_spec, optimize_outside=optimize_outside)
    with jax.set_mesh(m):
        got = program(*args)
    _assert_rewritten(opt, "blockwise")
    _close(got, fn(*args))


def _grads(fn, args):
    ct = jnp.asarray(np.random.default_rng(1).standard_normal(jax.eval_shape(fn, *args).shape))

    def loss(*a):
        return jnp.sum(fn(*a).astype(jnp.float32) * ct)

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*args)


def _assert_same_function(program, opt, fn, args, m, kernel):
    """The first call under ``m`` is rewritten to ``kernel`` and equals the
    unsharded original, output and q/k/v gradients."""
    with jax.set_mesh(m):
        got = program(*args)
        got_grads = _grads(program, args)
    _assert_rewritten(opt, kernel)
    _close(got, fn(*args))
    for g, w in zip(got_grads, _grads(fn, args), strict=True):
        _close(g, w, scale=5)


# (spelling, mesh axis size, q spec, k/v spec): heads split over 3 devices
# (H = 3), or query rows over 2 with k and v whole (a function of each query
# row, so not for the causal spellings, whose masks read local positions).
SHARDED = [
    ("causal_tril_where", 2, P("x"), P("x")),
    ("gqa_dot_product_attention", 2, P("x"), P("x")),
    ("einsum_btnh", 3, P(None, None, "x"), P(None, None, "x")),
    ("matmul_bnth", 3, P(None, "x"), P(None, "x")),
    ("deferred_normalisation", 2, P(None, None, "x"), P()),
    ("einsum_btnh", 2, P(None, "x"), P()),
]


@pytest.mark.parametrize(
    "name, n, q_spec, kv_spec", SHARDED, ids=[f"{s[0]}-{s[2]}" for s in SHARDED]
)
def test_sharded_gradients(name, n, q_spec, kv_spec):
    """Outputs and q/k/v gradients of the first call equal the unsharded original's."""
    fn, make = REWRITTEN[name]
    args = make(np.random.default_rng(0))
    m = mesh((n,), ("x",), explicit=False)
    program, opt = _wrapped(fn, m, (q_spec, kv_spec, kv_spec), q_spec, optimize_outside=False)
    _assert_same_function(program, opt, fn, args, m, "blockwise")


# Every kernel that runs on CPU in interpret mode, causal, batch over 2 devices.
INTERPRETED = [
    pytest.param(TILED, "blockwise", 16, id="blockwise"),
    pytest.param(
        PallasGpuKernel(),
        "pallas_gpu",
        64,
        id="pallas_gpu",
        marks=requires_triton,
    ),
    pytest.param(PallasTpuKernel(max_block=128), "pallas_tpu", 256, id="pallas_tpu"),
    pytest.param(SplashKernel(max_block=128), "splash", 256, id="splash"),
]


@pytest.mark.parametrize("kernel, name, t", INTERPRETED)
def test_every_interpreted_kernel(kernel, name, t):
    fn = spellings.causal_tril_where
    args = spellings.btnh(np.random.default_rng(0), t=t, s=t)
    m = mesh((2,), ("x",), explicit=False)
    program, opt = _wrapped(
        fn, m, (P("x"),) * 3, P("x"), optimize_outside=False, kernel=kernel, interpret=True
    )
    _assert_same_function(program, opt, fn, args, m, name)


def _decode(q, k, v, lengths):
    s = jnp.einsum("bhtd,bhsd->bhts", q, k) * 0.3
    keep = jnp.arange(k.shape[2])[None, None, None, :] < lengths[:, None, None, None]
    s = jnp.where(keep, s, -1e9)
    return jnp.einsum("bhts,bhsd->bhtd", jax.nn.softmax(s, axis=-1), v)


@pytest.mark.parametrize(
    "fn, kernel, make",
    [
        pytest.param(
            spellings.matmul_bnth,
            BlockwiseKernel(block_q=4, block_k=4, head_loop=True),
            spellings.bnth,
            id="head_loop",
        ),
        pytest.param(
            _decode,
            BlockwiseKernel(block_k=8),
            lambda r: (*spellings.bnth(r, t=1, s=40), jnp.asarray([17, 40], jnp.int32)),
            id="decode",
        ),
    ],
)
def test_blockwise_paths(fn, kernel, make):
    """The head loop and the decode path (per-row kv lengths, a chunk loop per
    row) inside the body, batch over 2 devices."""
    args = make(np.random.default_rng(0))
    m = mesh((2,), ("x",), explicit=False)
    specs = (P("x"),) * len(args)
    program, opt = _wrapped(fn, m, specs, P("x"), optimize_outside=False, kernel=kernel)
    _assert_same_function(program, opt, fn, args, m, "blockwise")
