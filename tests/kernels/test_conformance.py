"""One conformance suite for every kernel adapter.

Every adapter meets every case (causal, boolean mask, bias, padding, GQA, MQA,
cross-attention, odd lengths, soft-cap) in float32 and bfloat16.  For each
(adapter, case, dtype), either

* the kernel's declared capabilities (`Kernel.dtypes`, `Kernel.descriptors`)
  cover the case's dtype and `AttentionSpec.descriptors`, its `check` accepts
  it, and its forward output (and, where it declares `Kernel.grad`, its
  gradients w.r.t. q, k, v and every float extra, one compile) match the
  float64 `reference_attention`, or
* they do not, and `check` rejects it with a non-empty reason naming each
  missing capability (`WORDS`).

A combination that starts or stops being supported without the declarations
changing fails (`test_check_matches_declared_capabilities`), so support cannot
regress silently, and docs/kernels.md, generated from the same declarations,
cannot drift from `check`.  The dtypes float16 and float64 are checked too
(`check` only).

Pallas adapters run in interpret mode on CPU.  ``cudnn`` runs only on a GPU
(skipped here); its checks run under `compat.assume_cudnn`, and ``cudnn_xla``
(the same adapter calling ``jax.nn.dot_product_attention``'s XLA implementation,
one contract) checks its transforms numerically on any host.  ``tokamax`` is
skipped unless the package is installed and there is a GPU; ``tokamax_xla`` (the
same adapter calling tokamax's XLA implementation) runs wherever tokamax is
installed (the newest-JAX leg, ci/newest_jax.sh).  ``paged_tpu``, the TPU decode path,
takes only decode shapes (a few queries, head dims multiple of 128) that these
cases do not have; tests/kernels/test_paged_tpu.py covers each of its
descriptors the same way.

Cost: numerics compile one program per (adapter, case, dtype), 1-5 s each in
interpret mode.  The default run (`DEFAULT_NUMERICS`) covers every feature of
the new adapters (splash, pallas_gpu, cudnn_xla) at least once; ``blockwise``
and ``pallas_tpu``, which have their own numerics suites, run the padding case
(fully masked rows); everything else is ``slow``
(``pytest -m slow tests/kernels/test_conformance.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_testing import (
    BF16,
    BF16_OUT_TOL,
    F32,
    XLA_ATTENTION_BF16_OUT_TOL,
    bias_op,
    has_gpu,
    mask_op,
    normal,
    run_and_compare,
    spec_of,
)

from flashpass import compat
from flashpass.kernels import Causal, CheckContext, Kernel, Scale, Softcap
from flashpass.kernels.blockwise import BlockwiseKernel
from flashpass.kernels.chunked import ChunkedKernel
from flashpass.kernels.cudnn import CudnnKernel
from flashpass.kernels.flash_gpu import FlashGpuKernel
from flashpass.kernels.flash_tpu import FlashTpuKernel
from flashpass.kernels.paged_tpu import PagedTpuKernel
from flashpass.kernels.pallas_gpu import PallasGpuKernel
from flashpass.kernels.pallas_tpu import PallasTpuKernel
from flashpass.kernels.splash import SplashKernel
from flashpass.kernels.tokamax import TokamaxKernel
from flashpass.ops import BlockCausal, OuterMask, SinkWindow
from flashpass.spec import (
    DESCRIPTORS,
    FLOAT_DTYPES,
    Alibi,
    BandSelect,
    Chunk,
    KvLengths,
    PositionMask,
    Prefix,
    PrefixLengths,
    Segments,
    Sink,
    Window,
)

#: Kernels declaring `Kernel.ring_step` that tests/kernels/test_ring_steps.py runs.
RING_STEP_TESTED = {"blockwise", "pallas_gpu", "splash"}
#: Pallas kernels declaring `Kernel.dropout` whose keep-mask a test checks.
DROPOUT_TESTED = {"flash_tpu", "flash_gpu"}

# --------------------------------------------------------------------------- cases


@dataclasses.dataclass(frozen=True)
class Case:
    build: Callable  # dtype -> (spec, extras)


def _keep(shape, seed, p=0.7):
    keep = np.random.default_rng(seed).random(shape) < p
    keep[..., 0] = True  # every row keeps a key (fully masked rows: the padding case)
    return jnp.asarray(keep)


def _causal(dtype):
    return spec_of(t=24, dtype=dtype, ops=[Scale(0.25), Causal(0, -1e9)]), []


def _bool_mask(dtype):
    m, me = mask_op(0, (2, 1, 20, 28))
    spec = spec_of(t=20, s=28, dtype=dtype, ops=[Scale(0.25), m], extras=[me])
    return spec, [_keep(me.shape, 1)]


def _bias(dtype):
    b, be = bias_op(0, (1, 2, 20, 20), dtype)
    spec = spec_of(t=20, dtype=dtype, ops=[Scale(0.25), b], extras=[be])
    return spec, [2 * normal(be.shape, 2, dtype)]


def _padding(dtype):
    """Key padding: example 0 keeps its first 9 keys, example 1 none (a fully
    padded example: the reference averages v over all keys, fill -1e9)."""
    m, me = mask_op(0, (2, 1, 1, 24))
    keep = np.zeros(me.shape, bool)
    keep[0, ..., :9] = True
    spec = spec_of(t=16, s=24, dtype=dtype, ops=[Scale(0.25), m], extras=[me])
    return spec, [jnp.asarray(keep)]


def _gqa(dtype):
    return spec_of(h=4, hkv=2, t=24, dtype=dtype, ops=[Scale(0.25), Causal(0, -1e9)]), []


def _mqa(dtype):
    return spec_of(h=4, hkv=1, t=20, dtype=dtype, ops=[Scale(0.25)]), []


def _cross(dtype):
    return spec_of(t=12, s=40, dtype=dtype, ops=[Scale(0.25)]), []


def _odd(dtype):
    """Odd lengths and head dims, Dv != D, bottom-right causal (offset S - T)."""
    spec = spec_of(t=19, s=37, d=20, dv=12, dtype=dtype, ops=[Scale(0.3), Causal(18, -1e9)])
    return spec, []


def _softcap(dtype):
    return spec_of(t=24, dtype=dtype, ops=[Scale(0.25), Softcap(5.0), Causal(0, -1e9)]), []


def _window(dtype):
    """A causal sliding window: several key tiles skipped per query tile."""
    ops = [Scale(0.25), Causal(0, -1e9), Window(5, None, -1e9)]
    return spec_of(t=40, dtype=dtype, ops=ops), []


def _chunk(dtype):
    return spec_of(t=40, dtype=dtype, ops=[Scale(0.25), Chunk(12, -1e9), Causal(0, -1e9)]), []


def _prefix(dtype):
    return spec_of(t=40, dtype=dtype, ops=[Scale(0.25), Prefix(7, -1e9)]), []


def _segments(dtype):
    """Packed documents: sorted ids, one example with a query id no key has
    (its row is fully masked: the reference averages v, fill -1e9)."""
    ids = np.sort(np.random.default_rng(5).integers(0, 4, (2, 40)), axis=1).astype(np.int32)
    kv_ids = ids.copy()
    kv_ids[1][kv_ids[1] == kv_ids[1, -1]] = 99
    extras = [((2, 1, 40, 1), np.int32), ((2, 1, 1, 40), np.int32)]
    spec = spec_of(t=40, dtype=dtype, ops=[Scale(0.25), Segments(0, 1, -1e9)], extras=extras)
    return spec, [jnp.asarray(ids[:, None, :, None]), jnp.asarray(kv_ids[:, None, None, :])]


def _kv_lengths(dtype):
    """A decode step (two queries) against a ragged KV cache: rows filled to 0
    (fully masked), 9 and all 40 keys (`KvLengths`)."""
    op = KvLengths(0, (3, 1, 1, 1), -1e9, 0)
    spec = spec_of(
        b=3, t=2, s=40, dtype=dtype, ops=[Scale(0.25), op], extras=[((3, 1, 1, 1), "int32")]
    )
    return spec, [jnp.asarray(np.array([0, 9, 40], np.int32).reshape(3, 1, 1, 1))]


def _sinks(dtype):
    """Attention sinks (gpt-oss): a logit per head in the softmax, with
    GQA, causal and key padding; example 1 keeps no key (its rows put all their
    weight on the sink: the output is 0)."""
    m, me = mask_op(1, (2, 1, 1, 24))
    keep = np.zeros(me.shape, bool)
    keep[0, ..., :9] = True
    ops = [Scale(0.25), Causal(8, -1e9), m, Sink(0, (1, 4, 1, 1))]
    extras = [((1, 4, 1, 1), dtype), me]
    spec = spec_of(h=4, hkv=2, t=16, s=24, dtype=dtype, ops=ops, extras=extras)
    return spec, [2 * normal((1, 4, 1, 1), 6, dtype), jnp.asarray(keep)]


def _sink_window(dtype):
    """Sink tokens and a causal window (StreamingLLM): with 16-wide tiles the
    last query tiles visit the sink tile and skip the tiles before the window."""
    return spec_of(t=64, dtype=dtype, ops=[Scale(0.25), SinkWindow(3, 5, -1e9)]), []


def _block_causal(dtype):
    """Causal between blocks of 24 (bidirectional within one): with 16-wide
    tiles a block's last query tile reaches past its own position."""
    return spec_of(t=64, dtype=dtype, ops=[Scale(0.25), BlockCausal(24, -1e9)]), []


def _alibi(dtype):
    """ALiBi slopes per head (one negative: a growing bias) and a causal mask."""
    ops = [Scale(0.25), Alibi(0, (1, 2, 1, 1), 1, 0), Causal(0, -1e9)]
    spec = spec_of(t=40, dtype=dtype, ops=ops, extras=[((1, 2, 1, 1), dtype)])
    return spec, [jnp.asarray(np.array([0.5, -0.0625]).reshape(1, 2, 1, 1), dtype)]


def _prefix_lengths(dtype):
    """Prefix-LM with per-example prefixes of 0 (causal) and 13 keys."""
    ops = [Scale(0.25), PrefixLengths(0, (2, 1, 1, 1), -1e9, 0)]
    spec = spec_of(t=40, dtype=dtype, ops=ops, extras=[((2, 1, 1, 1), np.int32)])
    return spec, [jnp.asarray(np.array([0, 13], np.int32).reshape(2, 1, 1, 1))]


def _positions(dtype):
    """gemma's sliding mask on positions from an input (``kv > q - 5``, with
    the causal ``kv <= q``); example 1's positions restart at 17 (two documents)."""
    pos = np.stack([np.arange(40), np.r_[np.arange(17), np.arange(23)]]).astype(np.int32)
    ops = [
        Scale(0.25),
        PositionMask(0, 1, "gt", -1e9, 0, -5),
        PositionMask(0, 1, "le", -1e9),
    ]
    extras = [((2, 1, 40, 1), np.int32), ((2, 1, 1, 40), np.int32)]
    spec = spec_of(t=40, dtype=dtype, ops=ops, extras=extras)
    return spec, [jnp.asarray(pos[:, None, :, None]), jnp.asarray(pos[:, None, None, :])]


def _band_select(dtype):
    """keras-hub's int padding merged with a causal mask: below the diagonal
    the keys whose padding is non-zero (example 1 padded by 7 on the left),
    above it the keys whose padding is negative (example 1's key 30)."""
    below = np.ones((2, 1, 1, 40), bool)
    below[1, ..., :7] = False
    above = np.zeros((2, 1, 1, 40), bool)
    above[1, ..., 30] = True
    ops = [Scale(0.25), BandSelect((0, 1), (0,), (2, 1, 1, 40), -1e9)]
    extras = [((2, 1, 1, 40), np.bool_), ((2, 1, 1, 40), np.bool_)]
    spec = spec_of(t=40, dtype=dtype, ops=ops, extras=extras)
    return spec, [jnp.asarray(below), jnp.asarray(above)]


def _outer_mask(dtype):
    """DeBERTa's padding mask ``m[i] * m[j] != 0`` from one int vector read at
    both positions: example 1's last 7 queries keep no key (the reference
    averages v over every key, fill -1e9)."""
    m = np.ones((2, 40), np.int32)
    m[1, 33:] = 0
    m[0, 5] = 3  # any nonzero keeps
    ops = [Scale(0.25), OuterMask(0, 1, "mul", "ne", 0, -1e9, q_first=False)]
    extras = [((2, 1, 40, 1), np.int32), ((2, 1, 1, 40), np.int32)]
    spec = spec_of(t=40, dtype=dtype, ops=ops, extras=extras)
    return spec, [jnp.asarray(m[:, None, :, None]), jnp.asarray(m[:, None, None, :])]


CASES = {
    "causal": _causal,
    "bool_mask": _bool_mask,
    "bias": _bias,
    "padding": _padding,
    "gqa": _gqa,
    "mqa": _mqa,
    "cross": _cross,
    "odd": _odd,
    "softcap": _softcap,
    "window": _window,
    "chunk": _chunk,
    "prefix": _prefix,
    "segments": _segments,
    "kv_lengths": _kv_lengths,
    "sinks": _sinks,
    "sink_window": _sink_window,
    "block_causal": _block_causal,
    "alibi": _alibi,
    "prefix_lengths": _prefix_lengths,
    "positions": _positions,
    "band_select": _band_select,
    "outer_mask": _outer_mask,
}
DTYPES = {"f32": F32, "bf16": BF16}
#: `check` is also asked about these (no numerics).
CHECK_DTYPES = {**DTYPES, "f16": np.dtype(np.float16), "f64": np.dtype(np.float64)}
TOL = {"f32": 2e-5, "bf16": 3e-2}

# --------------------------------------------------------------------------- adapters


@dataclasses.dataclass(frozen=True)
class Adapter:
    make: Callable[[], Kernel]
    ctx: CheckContext  # where the suite checks (and runs) it
    interpret: bool = False
    runs_here: Callable[[], bool] = lambda: True
    skip_reason: str = ""
    check_context: Callable = contextlib.nullcontext  # entered around check()
    bf16_out_tol: float = BF16_OUT_TOL  # a bfloat16 output's per-row limit
    declines_all: str = ""  # set when this JAX makes it decline every site: a word of its reason


HERE = CheckContext(platform="cpu", explicit=True)
INTERPRET = CheckContext(platform="cpu", interpret=True, explicit=True)
GPU = CheckContext(platform="gpu", explicit=True)

ADAPTERS = {
    # 16-wide tiles: every case crosses several query and key tiles.
    "blockwise": Adapter(lambda: BlockwiseKernel(block_q=16, block_k=16, head_loop=False), HERE),
    # The same kernel run one (batch, kv head) unit at a time (the CPU default
    # for long sequences): unit slicing, and broadcast extras' summed gradients.
    "blockwise_heads": Adapter(
        lambda: BlockwiseKernel(block_q=16, block_k=16, head_loop=True), HERE
    ),
    # 16-row chunks: most cases cross chunks and end in a shorter tail chunk.
    "chunked": Adapter(lambda: ChunkedKernel(chunk=16), HERE),
    "pallas_tpu": Adapter(lambda: PallasTpuKernel(max_block=128), INTERPRET, interpret=True),
    # Our own Pallas TPU kernel: 16-row query tiles, so most cases cross several.
    "flash_tpu": Adapter(
        lambda: FlashTpuKernel(block_q=16, block_k=128), INTERPRET, interpret=True
    ),
    "splash": Adapter(lambda: SplashKernel(max_block=128), INTERPRET, interpret=True),
    # 16-wide blocks: several forward and backward blocks per case.
    "pallas_gpu": Adapter(
        lambda: PallasGpuKernel(block_q=16, block_k=16, block_bwd=16),
        GPU if has_gpu() else INTERPRET,
        interpret=not has_gpu(),
        runs_here=lambda: compat.TRITON_ATTENTION,
        skip_reason="JAX deprecates the Triton flash attention (0.11.1+)",
        declines_all="" if compat.TRITON_ATTENTION else "deprecates",
    ),
    # Our own op-protocol kernel on Pallas Triton (JAX < 0.11.1), interpreted here.
    "flash_gpu": Adapter(
        lambda: FlashGpuKernel(16, 16),
        GPU if has_gpu() else INTERPRET,
        interpret=not has_gpu(),
        runs_here=lambda: compat.TRITON_ATTENTION,
        skip_reason="JAX deprecates the Pallas Triton backend (0.11.1+)",
        declines_all="" if compat.TRITON_ATTENTION else "deprecates",
    ),
    "cudnn": Adapter(
        CudnnKernel,
        GPU,
        runs_here=has_gpu,
        skip_reason="cuDNN runs only on an NVIDIA GPU",
        check_context=compat.assume_cudnn,
    ),
    "cudnn_xla": Adapter(
        lambda: CudnnKernel(implementation="xla"),
        GPU,
        check_context=compat.assume_cudnn,
        bf16_out_tol=XLA_ATTENTION_BF16_OUT_TOL,
    ),
    "tokamax": Adapter(
        TokamaxKernel,
        GPU,
        runs_here=lambda: has_gpu() and compat.tokamax_module() is not None,
        skip_reason="needs the optional tokamax package and a GPU",
    ),
    # The same adapter calling tokamax's XLA implementation: runs on any host, so
    # the real package checks the adapter's mapping wherever it is installed.
    "tokamax_xla": Adapter(
        lambda: TokamaxKernel(implementation="xla"),
        GPU,
        runs_here=compat.tokamax_installed,
        skip_reason="needs the optional tokamax package (the gpu extra)",
    ),
}

#: A word the rejection reason must contain for each missing descriptor
#: (a missing dtype: its name).
WORDS = {
    "causal": "causal",
    "mask": "varies over queries",
    "key_mask": "mask",
    "bias": "bias",
    "softcap": "soft-cap",
    "gqa": "GQA",
    "window": "window",
    "chunk": "chunk",
    "prefix": "prefix",
    "segments": "segment",
    "kv_lengths": "kv lengths",
    "sinks": "sink",
    "sink_window": "sink tokens",
    "block_causal": "block-causal",
    "alibi": "ALiBi",
    "prefix_lengths": "prefix",
    "positions": "positions",
    "band_select": "band of diagonals",
    "outer_mask": "per-query and a per-key array",
}


def case_spec(case: str, dtype: str):
    """The case's spec (its arrays in their dtype, float64 included)."""
    with jax.enable_x64(dtype == "f64"):
        return CASES[case](CHECK_DTYPES[dtype])[0]


def declared(adapter: str, case: str, dtype: str) -> list[str]:
    """Words the reasons must contain (empty: declared supported): the dtype's
    name when the kernel does not declare it (adapters reject a dtype before
    looking further), else one per descriptor the case uses and the kernel
    does not declare."""
    kernel = type(ADAPTERS[adapter].make())
    spec = case_spec(case, dtype)
    if spec.q_dtype.name not in kernel.dtypes:
        return [spec.q_dtype.name]
    return [WORDS[d] for d in sorted(spec.descriptors - kernel.descriptors)]


#: The numerics run by default (the rest is marked slow; see module doc):
#: each new adapter on every feature it supports at least once, and the
#: fully masked rows of the padding case on the older adapters.
DEFAULT_NUMERICS = {
    "blockwise": {
        ("padding", "bf16"),
        ("sinks", "f32"),
        ("sinks", "bf16"),
        ("sink_window", "bf16"),
        ("block_causal", "f32"),
    },
    "blockwise_heads": {(c, "f32") for c in CASES} | {("gqa", "bf16"), ("bias", "bf16")},
    # Every per-query extra (sliced per chunk), a tail chunk, bfloat16 once.
    "chunked": {(c, "f32") for c in ("bias", "odd", "segments", "sinks", "positions", "kv_lengths")}
    | {("padding", "bf16")},
    "pallas_tpu": {("padding", "f32"), ("segments", "f32")},
    # (tests/kernels/test_flash_tpu.py runs its own matrix on larger tiles.)
    "flash_tpu": {("padding", "f32"), ("sinks", "bf16"), ("alibi", "f32"), ("positions", "f32")},
    "splash": {
        ("causal", "f32"),
        ("bool_mask", "f32"),
        ("padding", "f32"),
        ("odd", "f32"),
        ("softcap", "f32"),
        ("gqa", "bf16"),
        ("window", "f32"),
        ("chunk", "f32"),
        ("segments", "f32"),
        ("sinks", "f32"),
    },
    "pallas_gpu": {("causal", "f32"), ("padding", "f32"), ("odd", "f32"), ("gqa", "bf16")},
    "flash_gpu": {("alibi", "f32"), ("sinks", "bf16")},
    "cudnn": {(c, d) for c in CASES for d in DTYPES},  # skipped without a GPU
    "cudnn_xla": {(c, "bf16") for c in ("bias", "padding", "odd", "gqa", "window", "kv_lengths")},
    "tokamax": {(c, d) for c in CASES for d in DTYPES},  # skipped without tokamax
    # Every case it supports (bfloat16 only: it declines float32); skipped without tokamax.
    "tokamax_xla": {(c, "bf16") for c in CASES},
}


def _combinations(numerics: bool):
    for adapter in ADAPTERS:
        for case in CASES:
            for dtype in DTYPES if numerics else CHECK_DTYPES:
                marks = []
                if numerics and (case, dtype) not in DEFAULT_NUMERICS[adapter]:
                    marks.append(pytest.mark.slow)
                yield pytest.param(
                    adapter, case, dtype, marks=marks, id=f"{adapter}-{case}-{dtype}"
                )


def _check(adapter: str, spec) -> list[str]:
    a = ADAPTERS[adapter]
    with a.check_context():
        if adapter.startswith("tokamax") and not compat.tokamax_installed():
            pytest.skip("the optional tokamax package is not installed")
        return a.make().check(spec, a.ctx)


@pytest.mark.parametrize("adapter,case,dtype", list(_combinations(numerics=False)))
def test_check_matches_declared_capabilities(adapter, case, dtype):
    """check() accepts exactly the combinations the kernel's capabilities
    cover, and rejects the others with a reason that says why."""
    spec = case_spec(case, dtype)
    reasons = _check(adapter, spec)
    if ADAPTERS[adapter].declines_all:
        assert any(ADAPTERS[adapter].declines_all in r for r in reasons), reasons
        return
    words = declared(adapter, case, dtype)
    if not words:
        assert reasons == [], f"{adapter} rejects {case}/{dtype}, declared supported: {reasons}"
        return
    assert reasons, f"{adapter} accepts {case}/{dtype}, declared unsupported"
    assert all(isinstance(r, str) and r.strip() for r in reasons), reasons
    for word in words:
        assert any(word in r for r in reasons), (word, reasons)


@pytest.mark.parametrize("adapter,case,dtype", list(_combinations(numerics=True)))
def test_numerics_match_reference(adapter, case, dtype):
    """Forward and gradients against the float64 reference (supported combinations)."""
    if declared(adapter, case, dtype):
        pytest.skip("declared unsupported (see test_check_matches_declared_capabilities)")
    a = ADAPTERS[adapter]
    if not a.runs_here():
        pytest.skip(a.skip_reason)
    spec, extras = CASES[case](DTYPES[dtype])
    kernel = a.make()
    assert _check(adapter, spec) == []
    run_and_compare(
        kernel,
        spec,
        extras,
        tol=TOL[dtype],
        grad=kernel.grad,
        interpret=a.interpret,
        bf16_out_tol=a.bf16_out_tol,
    )


def test_cases_cover_every_descriptor_and_declarations_are_known():
    used = set().union(*(build(F32)[0].descriptors for build in CASES.values()))
    assert used == set(DESCRIPTORS) == set(WORDS)
    for a in ADAPTERS.values():
        kernel = type(a.make())
        assert kernel.descriptors <= set(DESCRIPTORS), kernel.name
        assert kernel.dtypes <= FLOAT_DTYPES, kernel.name
        assert isinstance(kernel.grad, bool) and isinstance(kernel.partitionable, bool)
        assert kernel.plain_jax <= kernel.partitionable  # plain JAX: XLA partitions it
        # Exact dropout: the plain-JAX kernels, and those whose keep-mask is
        # checked bit-equal to blockwise's (tests/kernels/test_flash_tpu.py).
        assert kernel.dropout <= (kernel.plain_jax or kernel.name in DROPOUT_TESTED)
        # Ring steps: tests/kernels/test_ring_steps.py runs each declaring kernel.
        assert not kernel.ring_step or kernel.name in RING_STEP_TESTED, kernel.name
        assert kernel.grad or not kernel.ring_step  # the ring's backward runs its steps'


@pytest.mark.parametrize(
    "kernel",
    [
        BlockwiseKernel(),
        PallasTpuKernel(),
        FlashTpuKernel(),
        FlashGpuKernel(),
        SplashKernel(),
        CudnnKernel(),
        PallasGpuKernel(),
        PagedTpuKernel(),
    ],
    ids=lambda k: k.name,
)
def test_require_raises_with_the_kernel_name_and_every_reason(kernel):
    name = kernel.name
    kernel.require([])  # nothing against it: no error
    with pytest.raises(ValueError, match=rf"^{name} cannot run this attention: first; second$"):
        kernel.require(["first", "second"])
