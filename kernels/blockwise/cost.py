"""Where the blockwise kernel pays on CPU: the cost-based choice, in one place.

`faster_as_written` says when the original program is faster than the
kernel, from the site's q length, kv length, batch, heads, dtype and
platform; the kernel then declines with the reason "kept: faster as written"
(naming ``kernel='blockwise'`` still forces it).  The thresholds are measured
(`benchmarks/crossover.py` for prefill, `benchmarks/decode.py` for decode
steps; tables in docs/benchmarks.md, "Crossover" and "Decode").
"""

from __future__ import annotations

from flashpass.spec import AttentionSpec, KvLengths

from .plan import CPU_MIN_KV_LEN

#: Queries per row up to which a site is a decode step (one new token, or a
#: few of speculative decoding / small chunked prefill).
DECODE_MAX_Q = 16
#: Keys per chunk of the decode path: a ``[Hkv, 1024, 64]`` f32 slice is 2 MiB
#: at 8 heads, large enough that the loop's per-chunk overhead is small.
DECODE_BLOCK_K = 1024
#: The decode path visits only the chunks below each row's length, but a
#: visited key costs it about twice what the original's single pass over the
#: whole cache costs (each chunk is sliced out of the cache).  So at run time
#: it runs that single pass instead when more than this fraction of the cache
#: would be visited (full rows), and the chunk loop otherwise.
DECODE_DENSE_FRACTION = 0.5
#: Decode with per-row kv lengths pays from this cache length on (skipping
#: the chunks past each row's length); below it the masked original is as
#: fast or faster (`benchmarks/decode.py --table`).
DECODE_MIN_KV_LEN = 2048
#: With a single score row per kv head (one query, no grouped heads) a chunk
#: is a matrix-vector product: the loop's per-chunk cost is not repaid below
#: this cache length (ragged 2k rows ran 0.3-0.75x, 4k rows 0.9-1.15x, at
#: every batch, head count and dtype of the table).
DECODE_MIN_KV_LEN_ONE_ROW = 8192
#: The same with the cache held as ``[B, S, H, D]`` (``kv_layout="bshd"``,
#: read as it is): the original's products over that layout are several
#: times slower on CPU than over ``[B, H, S, D]``, the decode path's chunks
#: are not, so one row per kv head pays from a shorter cache (forced decode
#: path, B=4, H=8, f32: min(full, ragged) 0.97x at 2k, 1.02x at 4k, 1.22x at
#: 8k; `benchmarks/decode.py --kernel blockwise --layout bshd`).
DECODE_MIN_KV_LEN_ONE_ROW_BSHD = 4096
#: Narrow floats (bf16, f16) with several rows per kv head: the original's
#: narrow products are slow on CPU and the kernel computes in float32, so it
#: pays from this (shorter) cache length on (1.5-4x at 1k keys in the table).
DECODE_MIN_KV_LEN_NARROW = 1024
_NARROW = ("bfloat16", "float16")


def decode_min_kv_len(spec: AttentionSpec, kv_layout: str = "bhsd") -> int:
    """The cache length from which the decode path beats the original on CPU,
    by the score rows per kv head (queries x grouped heads), the dtype, the
    cache's layout and `DECODE_MIN_KV_LEN`; batch and head count move no
    threshold in the table (``python benchmarks/decode.py --table``: B=1..16,
    H=2..32)."""
    rows = spec.q_len * spec.groups
    if rows == 1:
        if kv_layout == "bshd":
            return DECODE_MIN_KV_LEN_ONE_ROW_BSHD
        return DECODE_MIN_KV_LEN_ONE_ROW
    if str(spec.q_dtype) in _NARROW and str(spec.k_dtype) in _NARROW:
        return DECODE_MIN_KV_LEN_NARROW
    return DECODE_MIN_KV_LEN


def faster_as_written(spec: AttentionSpec, platform: str, kv_layout: str = "bhsd") -> str | None:
    """Why the original computation beats the blockwise kernel for ``spec``
    on ``platform``, k and v read in ``kv_layout`` (None where the kernel is
    as fast or faster)."""
    if platform != "cpu":
        return None
    lengths = bool(spec.ops_of(KvLengths))
    if spec.q_len <= DECODE_MAX_Q:
        if not lengths:
            # One query's scores are a [B, H, T, S] row: the original never
            # forms more than that, and XLA fuses it; the kernel's loop only
            # adds overhead (0.8x at 2k keys, 0.98x at 32k).
            return (
                f"decode step (q_len={spec.q_len} <= {DECODE_MAX_Q}) without per-row kv "
                "lengths: the original is as memory-efficient and faster"
            )
        shortest = decode_min_kv_len(spec, kv_layout)
        if spec.kv_len < shortest:
            rows = spec.q_len * spec.groups
            return (
                f"short kv cache (kv_len={spec.kv_len} < {shortest}) for a decode step with "
                f"{rows} score row{'s' if rows > 1 else ''} per kv head, {spec.q_dtype}"
                + (", cache [B, S, H, D]" if kv_layout == "bshd" else "")
            )
        return None
    if spec.kv_len < CPU_MIN_KV_LEN:
        return f"short sequence (kv_len={spec.kv_len} < {CPU_MIN_KV_LEN})"
    return None
