"""``flash_tpu``, our own Pallas TPU flash attention built from the op protocol.

* Numerics (interpret mode on CPU), forward and gradient against the float64
  reference, on tiles that skip and split: ``T = S = 256`` with 32 x 128
  tiles, over the op kinds and their combinations (`MATRIX`; a handful by
  default, the rest ``slow``).  tests/kernels/test_conformance.py runs the
  suite's cases on it too.
* Dropout: the keep-mask its tiles draw is bit-equal to the one the blockwise
  kernel evaluates (`flashpass.kernels.dropout.keep_mask`) and to the one
  ``jax.random.bernoulli`` drew; a program with dropout, rewritten to it, is
  the same function (outputs and gradients).
* Export for TPU from this host: each site the issue names, optimized with the
  default TPU order at ``T = S = 2048`` in bfloat16, is a ``tpu_custom_call``
  with no tensor of ``T * S`` elements in the module, forward and gradient.
* Selection: a kernel that would build a ``T x S`` array is passed over for
  one that takes the site in O(T), unless named, and the report says so.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_testing import BF16, F32, bias_op, mask_op, normal, run_and_compare, spec_of

import flashpass
from flashpass import compat
from flashpass.kernels import CheckContext, get_kernel
from flashpass.kernels.dropout import keep_mask, reference_keep
from flashpass.kernels.flash_tpu import FlashTpuKernel, default_blocks, dropout_keep
from flashpass.ops import SinkWindow
from flashpass.select import choose
from flashpass.spec import (
    Alibi,
    Causal,
    Chunk,
    Dropout,
    KvLengths,
    PositionMask,
    Prefix,
    PrefixLengths,
    Scale,
    Segments,
    Sink,
    Softcap,
    Window,
)
from flashpass.testing import assert_same_function

N = 256  # queries and keys of the numerics: 8 x 2 tiles
KERNEL = FlashTpuKernel(block_q=32, block_k=128)
TOL = {"f32": 2e-5, "bf16": 3e-2}
DTYPES = {"f32": F32, "bf16": BF16}


def _valid(b=2, s=N, lengths=(200, 131)):
    keep = np.arange(s)[None, :] < np.array(lengths)[:, None]
    return jnp.asarray(keep.reshape(b, 1, 1, s))


def _ids():
    ids = np.ones((2, N), np.int32)
    ids[:, 90:] = 2
    ids[1, 170:] = 3
    ids[1, 230:] = 0  # padding: an id no query of example 1 has before it
    return ids


# --------------------------------------------------------------------------- the matrix


def causal_window_key(dtype):
    m, me = mask_op(0, (2, 1, 1, N))
    ops = [Scale(0.125), Causal(0, -1e9), Window(40, None, -1e9), m]
    return spec_of(t=N, dtype=dtype, ops=ops, extras=[me]), [_valid()]


def sink_window(dtype):
    return spec_of(t=N, dtype=dtype, ops=[Scale(0.125), SinkWindow(4, 48, -1e9)]), []


def chunk_causal(dtype):
    return spec_of(t=N, dtype=dtype, ops=[Scale(0.125), Chunk(96, -1e9), Causal(0, -1e9)]), []


def prefix(dtype):
    return spec_of(t=N, dtype=dtype, ops=[Scale(0.125), Prefix(70, -1e9)]), []


def prefix_lengths_key(dtype):
    m, me = mask_op(1, (2, 1, 1, N))
    ops = [Scale(0.125), PrefixLengths(0, (2, 1, 1, 1), -1e9, 0), m]
    extras = [((2, 1, 1, 1), np.int32), me]
    lengths = jnp.asarray(np.array([0, 150], np.int32).reshape(2, 1, 1, 1))
    return spec_of(t=N, dtype=dtype, ops=ops, extras=extras), [lengths, _valid()]


def alibi_softcap(dtype):
    """Float32 slopes (as models keep them): their cotangent, a sum over
    ``T x S`` products that nearly cancels, is not rounded to bfloat16."""
    ops = [Scale(0.125), Alibi(0, (1, 2, 1, 1), 1, 0), Softcap(20.0), Causal(0, -1e9)]
    slopes = jnp.asarray(np.array([0.5, 0.125]).reshape(1, 2, 1, 1), F32)
    return spec_of(t=N, dtype=dtype, ops=ops, extras=[((1, 2, 1, 1), F32)]), [slopes]


def alibi_keys_padding(dtype):
    """Bloom's ``slope * j`` with key padding."""
    m, me = mask_op(1, (2, 1, 1, N))
    ops = [Scale(0.125), Alibi(0, (1, 2, 1, 1), 0, 0), m]
    slopes = jnp.asarray(np.array([0.0625, 0.015625]).reshape(1, 2, 1, 1), dtype)
    return spec_of(t=N, dtype=dtype, ops=ops, extras=[((1, 2, 1, 1), dtype), me]), [
        slopes,
        _valid(),
    ]


def segments_padding(dtype):
    ids = _ids()
    extras = [((2, 1, N, 1), np.int32), ((2, 1, 1, N), np.int32)]
    spec = spec_of(t=N, dtype=dtype, ops=[Scale(0.125), Segments(0, 1, -1e9, True)], extras=extras)
    return spec, [jnp.asarray(ids[:, None, :, None]), jnp.asarray(ids[:, None, None, :])]


def kv_lengths(dtype):
    op = KvLengths(0, (2, 1, 1, 1), -1e9, 0)
    spec = spec_of(t=N, dtype=dtype, ops=[Scale(0.125), op], extras=[((2, 1, 1, 1), np.int32)])
    return spec, [jnp.asarray(np.array([77, N], np.int32).reshape(2, 1, 1, 1))]


def positions(dtype):
    pos = np.stack([np.arange(N), np.r_[np.arange(100), np.arange(N - 100)]]).astype(np.int32)
    ops = [Scale(0.125), PositionMask(0, 1, "gt", -1e9, 0, -60), PositionMask(0, 1, "le", -1e9)]
    extras = [((2, 1, N, 1), np.int32), ((2, 1, 1, N), np.int32)]
    spec = spec_of(t=N, dtype=dtype, ops=ops, extras=extras)
    return spec, [jnp.asarray(pos[:, None, :, None]), jnp.asarray(pos[:, None, None, :])]


def gqa_sinks_window(dtype):
    ops = [Scale(0.125), Causal(0, -1e9), Window(60, None, -1e9), Sink(0, (1, 4, 1, 1))]
    spec = spec_of(h=4, hkv=2, t=N, dtype=dtype, ops=ops, extras=[((1, 4, 1, 1), dtype)])
    return spec, [2 * normal((1, 4, 1, 1), 7, dtype)]


def dense_bias_cross(dtype):
    """A bias the program holds as ``[1, H, T, S]`` (read tile by tile), odd
    lengths (padded query rows and keys), ``Dv != D``."""
    b, be = bias_op(0, (1, 2, 100, 200), dtype)
    spec = spec_of(t=100, s=200, dv=8, dtype=dtype, ops=[Scale(0.125), b], extras=[be])
    return spec, [normal(be.shape, 3, dtype)]


MATRIX = {
    f.__name__: f
    for f in (
        causal_window_key,
        sink_window,
        chunk_causal,
        prefix,
        prefix_lengths_key,
        alibi_softcap,
        alibi_keys_padding,
        segments_padding,
        kv_lengths,
        positions,
        gqa_sinks_window,
        dense_bias_cross,
    )
}
DEFAULT = {("causal_window_key", "f32"), ("alibi_softcap", "bf16"), ("gqa_sinks_window", "f32")}


def _matrix():
    for name in MATRIX:
        for dtype in DTYPES:
            marks = [] if (name, dtype) in DEFAULT else [pytest.mark.slow]
            yield pytest.param(name, dtype, marks=marks, id=f"{name}-{dtype}")


@pytest.mark.parametrize("name,dtype", list(_matrix()))
def test_matrix_matches_the_reference(name, dtype):
    """Forward and gradients (q, k, v, float extras) in interpret mode."""
    spec, extras = MATRIX[name](DTYPES[dtype])
    assert KERNEL.check(spec, CheckContext("cpu", interpret=True)) == []
    run_and_compare(KERNEL, spec, extras, tol=TOL[dtype])


def test_tiles_are_skipped_and_split():
    """A causal plan skips the tiles above the diagonal and runs those below
    it without the predicate (the numerics above run both kinds, and fold in
    the skipped tiles of rows that keep no key)."""
    spec, _ = causal_window_key(F32)
    assert KERNEL.plan(spec).fold == -1e9
    spec = spec_of(t=N, ops=[Scale(0.125), Causal(0, -1e9)])
    plan = KERNEL.plan(spec)
    assert (plan.nq, plan.nk) == (8, 2)
    assert {type(op).__name__ for op in plan.skips} == {"Causal"}
    r = lambda i: (i * 32, i * 32 + 31)  # noqa: E731
    states = [
        [np.asarray(op.tile_state(*r(i), j * 128, j * 128 + 127)) for op in plan.skips]
        for i in range(8)
        for j in range(2)
    ]
    empty = [any(bool(e) for e, _ in s) for s in states]
    full = [all(bool(f) for _, f in s) for s in states]
    assert any(empty) and any(full) and not all(full)


def test_block_sizes_follow_splash_and_can_be_set():
    sa = compat.splash_attention_module()
    default = sa.BlockSizes.get_default()
    assert FlashTpuKernel().blocks() == default_blocks() == (default.block_q, default.block_kv)
    assert FlashTpuKernel(block_q=256, block_k=512).blocks() == (256, 512)
    spec = spec_of(t=1024, s=2048, ops=[Scale(0.1)])
    plan = FlashTpuKernel(block_q=256, block_k=512).plan(spec)
    assert (plan.bq, plan.bk, plan.nq, plan.nk) == (256, 512, 4, 4)
    with pytest.raises(ValueError, match="block_k"):
        FlashTpuKernel(block_k=0)


# --------------------------------------------------------------------------- dropout


def _dropout_spec(t=40, s=136, h=3):
    op = Dropout(
        index=0,
        shape=(1, 1, 1, 2),
        mask_shape=(2, h, t, s),
        axes=(((2, h * t * s),), ((h, t * s),), ((t, s),), ((s, 1),)),
        bits=32,
        uniform_dtype="float32",
        threshold=0.8,
        keep_below=True,
        scale=1 / 0.8,
    )
    extras = [((1, 1, 1, 2), np.uint32)]
    return spec_of(h=h, t=t, s=s, ops=[Scale(0.25), Causal(s - t, -1e9), op], extras=extras)


def test_dropout_keep_mask_is_bit_equal_to_blockwise_and_jax_random():
    spec = _dropout_spec()
    key = jax.random.key_data(jax.random.key(3)).reshape(1, 1, 1, 2)
    tiles = dropout_keep(spec, key, block_q=16, block_k=128, interpret=True)
    b, h, t, s = (
        jnp.arange(n).reshape([n if i == a else 1 for i in range(4)])
        for a, n in enumerate((spec.batch, spec.heads, spec.q_len, spec.kv_len))
    )
    blockwise = keep_mask(spec.dropout, key, b, h, t, s)  # what blockwise's tiles evaluate
    np.testing.assert_array_equal(np.asarray(tiles), np.asarray(blockwise).astype(np.int32))
    drawn = reference_keep(spec, spec.dropout, key)  # jax.random.bernoulli's own
    np.testing.assert_array_equal(np.asarray(tiles), np.asarray(drawn).astype(np.int32))
    assert 0.7 < float(np.mean(np.asarray(drawn))) < 0.9


def test_dropout_numerics_match_the_reference():
    spec = _dropout_spec()
    key = jax.random.key_data(jax.random.key(5)).reshape(1, 1, 1, 2)
    run_and_compare(FlashTpuKernel(block_q=16, block_k=128), spec, [key], tol=2e-5)


def _dropout_program(q, k, v, key):
    s = jnp.einsum("bthd,bshd->bhts", q, k) * 0.25
    i, j = jnp.arange(q.shape[1])[:, None], jnp.arange(k.shape[1])[None, :]
    p = jax.nn.softmax(jnp.where(j <= i, s, -1e9), -1)
    keep = jax.random.bernoulli(key, 0.9, p.shape)
    return jnp.einsum("bhts,bshd->bthd", jnp.where(keep, p / 0.9, 0.0), v)


@pytest.mark.slow  # (about a minute in interpret mode)
def test_program_with_dropout_is_the_same_function():
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((2, 48, 2, 16)), jnp.float32) for _ in range(3))
    key = jax.random.key(11)
    opt = flashpass.optimize(
        _dropout_program, kernel=FlashTpuKernel(16, 128), platform="cpu", interpret=True
    )
    report = opt.explain(q, k, v, key)
    assert report.kernels == ["flash_tpu"] and report.rewrites[0].dropout, str(report)
    assert_same_function(_dropout_program, opt, q, k, v, key, argnums=(0, 1, 2))


# --------------------------------------------------------------------------- export for TPU

# B * T * H * D < T * S: q, k, v hold fewer elements than one score matrix.
EB, EH, ET, ED = 1, 8, 2048, 128


def _attend(q, k, v, keep=None, bias=None, drop_key=None, sinks=None):
    s = jnp.einsum("bthd,bshd->bhts", q, k).astype(jnp.float32) / math.sqrt(ED)
    if bias is not None:
        s = s + bias
    if keep is not None:
        s = jnp.where(keep, s, -1e9)
    if sinks is not None:
        col = jnp.broadcast_to(sinks.reshape(1, -1, 1, 1), (*s.shape[:-1], 1))
        p = jax.nn.softmax(jnp.concatenate([s, col], -1), -1)[..., :-1]
    else:
        p = jax.nn.softmax(s, -1)
    if drop_key is not None:
        p = jnp.where(jax.random.bernoulli(drop_key, 0.9, p.shape), p / 0.9, 0.0)
    return jnp.einsum("bhts,bshd->bthd", p.astype(v.dtype), v)


def _ij():
    pos = jnp.arange(ET)
    return pos[:, None], pos[None, :]


def hf_padding(q, k, v, valid):
    """Hugging Face: causal and key padding as an additive finite fill."""
    i, j = _ij()
    keep = (j <= i)[None, None] & valid[:, None, None, :]
    return _attend(q, k, v, bias=jnp.where(keep, 0.0, jnp.finfo(jnp.float32).min))


def alibi(q, k, v, slopes):
    i, j = _ij()
    bias = slopes[None, :, None, None] * (j - i).astype(jnp.float32)
    return _attend(q, k, v, j <= i, bias=bias)


def dropout(q, k, v, key):
    i, j = _ij()
    return _attend(q, k, v, j <= i, drop_key=key)


def prefix_lm(q, k, v, lengths):
    i, j = _ij()
    return _attend(q, k, v, (j <= i)[None, None] | (j[None, None] < lengths[:, None, None, None]))


def positions_from_inputs(q, k, v, pos):
    kv, qp = pos[:, None, :], pos[:, :, None]
    return _attend(q, k, v, ((kv > qp - 512) & (kv <= qp))[:, None])


def sink_and_window(q, k, v, sinks):
    """gpt-oss: a sink logit per head and a causal sliding window."""
    i, j = _ij()
    return _attend(q, k, v, (j <= i) & (j > i - 512), sinks=sinks)


def segments_with_padding(q, k, v, ids):
    keep = (ids[:, :, None] == ids[:, None, :]) & (ids[:, None, :] > 0)  # id 0: padding
    return _attend(q, k, v, keep[:, None])


def kv_lengths_site(q, k, v, lengths):
    j = jnp.arange(ET)
    return _attend(q, k, v, j[None, None, None, :] < lengths[:, None, None, None])


def _site_input(name):
    rows = np.arange(ET)
    return {
        "hf_padding": lambda: jnp.asarray(rows[None, :] < 1500),
        "alibi": lambda: jnp.asarray(2.0 ** -np.arange(1, EH + 1), jnp.float32),
        "dropout": lambda: jax.random.key(0),
        "prefix_lm": lambda: jnp.asarray([100], jnp.int32),
        "positions_from_inputs": lambda: jnp.asarray(np.r_[rows[:300], rows[: ET - 300]][None]),
        "sink_and_window": lambda: jnp.asarray(np.linspace(-1, 1, EH), jnp.float32),
        "segments_with_padding": lambda: jnp.asarray(
            np.where(rows < 1800, 1 + rows // 1024, 0)[None].astype(np.int32)
        ),
        "kv_lengths_site": lambda: jnp.asarray([1000], jnp.int32),
    }[name]()


SITES = {
    f.__name__: f
    for f in (
        hf_padding,
        alibi,
        dropout,
        prefix_lm,
        positions_from_inputs,
        sink_and_window,
        segments_with_padding,
        kv_lengths_site,
    )
}


def _exported_ops(fn, *args):
    exported = jax.export.export(jax.jit(fn), platforms=["tpu"])(*args)
    return compat.stablehlo_ops(compat.parse_stablehlo(exported.mlir_module()))


#: The export checks run by default (the others are marked slow).
QUICK_SITES = {"hf_padding", "alibi", "dropout"}


@pytest.mark.parametrize(
    "name", [n if n in QUICK_SITES else pytest.param(n, marks=pytest.mark.slow) for n in SITES]
)
def test_site_exports_for_tpu_as_a_kernel_without_t_by_s(name):
    fn = SITES[name]
    qkv = [jax.ShapeDtypeStruct((EB, ET, EH, ED), jnp.bfloat16)] * 3
    extra = _site_input(name)
    opt = flashpass.optimize(fn, platform="tpu")
    report = opt.explain(*qkv, extra)
    assert len(report.rewrites) == 1 and not report.fallbacks, str(report)
    assert report.kernels[0] in ("flash_tpu", "splash"), str(report)
    assert "materialises" not in str(report), str(report)
    loss = lambda q, k, v, e: opt(q, k, v, e).astype(jnp.float32).sum()  # noqa: E731
    grad = jax.grad(loss, argnums=(0, 1, 2))
    for program in (opt, grad):
        ops = _exported_ops(program, *qkv, extra)
        assert any(target == "tpu_custom_call" for _, _, target in ops)
        big = {s for _, shapes, _ in ops for s in shapes if math.prod(s) >= ET * ET}
        assert not big, big
    # The original holds the scores.
    ops = _exported_ops(fn, *qkv, extra)
    assert any(math.prod(s) >= ET * ET for _, shapes, _ in ops for s in shapes)


# --------------------------------------------------------------------------- selection


def _padding_spec(n=256):
    """A finite-fill key mask as an additive bias ``[B, 1, 1, S]``, which
    ``pallas_tpu`` takes by materialising ``[B, H, T, S]``."""
    b, be = bias_op(0, (2, 1, 1, n))
    return spec_of(t=n, d=32, ops=[Scale(0.1), Causal(0, -1e9), b], extras=[be])


def test_a_kernel_that_materialises_t_by_s_is_passed_over():
    spec = _padding_spec()
    kernels = [get_kernel("pallas_tpu"), get_kernel("flash_tpu")]
    kernel, rejections = choose(spec, kernels, CheckContext("tpu"))
    assert kernel.name == "flash_tpu"
    (reason,) = rejections["pallas_tpu"]
    assert "materialises T×S" in reason and "[2, 2, 256, 256]" in reason, reason
    # Named by the user, it runs the site (the report says what it builds).
    kernel, rejections = choose(spec, kernels, CheckContext("tpu", explicit=True))
    assert kernel.name == "pallas_tpu" and not rejections
    # With no O(T) kernel after it, it still runs the site.
    kernel, _ = choose(spec, kernels[:1], CheckContext("tpu"))
    assert kernel.name == "pallas_tpu"


def _hf_small(q, k, v, valid):
    n = q.shape[1]
    i, j = jnp.arange(n)[:, None], jnp.arange(n)[None, :]
    s = jnp.einsum("bthd,bshd->bhts", q, k) / math.sqrt(q.shape[-1])
    s = s + jnp.where((j <= i)[None, None] & valid[:, None, None, :], 0.0, -1e9)
    return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, -1), v)


def test_the_report_says_materialises_when_the_user_names_such_a_kernel():
    qkv = [jax.ShapeDtypeStruct((2, 256, 2, 32), jnp.float32)] * 3
    valid = jnp.asarray(np.arange(256)[None, :] < np.array([[200], [256]]))
    named = flashpass.optimize(_hf_small, kernel="pallas_tpu", platform="tpu").explain(*qkv, valid)
    assert named.kernels == ["pallas_tpu"], str(named)
    assert "materialises T×S" in str(named), str(named)
    default = flashpass.optimize(_hf_small, platform="tpu").explain(*qkv, valid)
    assert default.kernels == ["flash_tpu"] and "materialises" not in str(default), str(default)
