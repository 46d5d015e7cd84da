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
#: the chunks past each row's length); below it the masked original is faster.
DECODE_MIN_KV_LEN = 2048


def faster_as_written(spec: AttentionSpec, platform: str) -> str | None:
    """Why the original computation beats the blockwise kernel for ``spec``
    on ``platform`` (None where the kernel is as fast or faster)."""
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
        if spec.kv_len < DECODE_MIN_KV_LEN:
            return f"short kv cache (kv_len={spec.kv_len} < {DECODE_MIN_KV_LEN}) for a decode step"
        return None
    if spec.kv_len < CPU_MIN_KV_LEN:
        return f"short sequence (kv_len={spec.kv_len} < {CPU_MIN_KV_LEN})"
    return None
