"""Adapter for JAX's Pallas TPU paged-attention kernel: the TPU decode path.

``jax.experimental.pallas.ops.tpu.paged_attention`` attends one query per
(sequence, query head) to a KV cache stored in pages, and visits only the
pages below each sequence's length: a ragged batch skips its empty blocks.
It is built for decode steps; this module maps a decode-shaped
`AttentionSpec` onto it exactly:

* The contiguous cache ``[B, Hkv, S, D]`` is viewed, by a reshape, as pages
  ``[1, B*Hkv*S/P, P, D]`` (no copy for a cache stored in that order; one
  stored ``[B, S, Hkv, D]`` is transposed first, as for every kernel):
  every (batch row, kv head) is one of the kernel's sequences, with its own
  row of the page table (consecutive pages) and one kv head.  Its query heads are the group's ``G``
  heads times the ``T`` queries, ``q [B*Hkv, G*T, D]``: GQA and a few queries
  at once cost nothing.
* Scale ops: the product is folded into ``q`` in float32 (the kernel reads
  ``q`` as float32).  Softcap: the kernel's ``attn_logits_soft_cap``, applied
  to those scaled logits, as `_linear.linear_form` orders them.
* ``KvLengths`` (one count per batch row, ``[B|1, 1, 1, 1]``): the kernel's
  ``lengths`` (the minimum over several ops), repeated per kv head.  No
  lengths: every row is full.  All queries of a row see the same keys, so a
  causal mask among several queries, masks, biases, windows, segments and
  sinks are declined (`blockwise` or `splash` run them).
* Rows of length 0 keep no key: the kernel leaves them unwritten, and they
  get the mean of ``v`` (`_util.fill_empty_rows`), the reference's result for
  a finite fill (NaN for ``-inf``: the documented difference of the TPU
  adapters).
* Pages are the largest divisor of ``S`` that is a multiple of 16 and at most
  128 keys, and head dims must be multiples of 128 with ``Dv == D`` (the
  kernel's blocks need them, k and v pages share a shape): anything else
  would copy the whole cache into a padded one at every step, which costs
  a decode step more than it saves, so such sites are declined.
* Gradients: the kernel has none.  The backward is the reference attention's
  (recomputed, ``[B, H, T, S]`` scores: small for a few queries), so a decode
  step inside a differentiated program still gets exact gradients.
* Precision: the kernel's products run at the default matmul precision,
  which rounds float32 operands to bfloat16 on TPU (measured in interpret
  mode: relative errors of ~2e-3 on float32 inputs), so it takes bfloat16
  attention only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from flashpass import compat
from flashpass.spec import AttentionSpec

from . import _linear, _tpu, _util
from .reference import reference_attention

#: At most this many queries per row: a decode step (one token) or a few
#: (speculative decoding); longer query blocks go to the flash kernels.
MAX_QUERIES = 16
#: Keys per page at most (pages are a divisor of the cache length, a multiple
#: of `PAGE_MULTIPLE`: the sublanes of a bfloat16 tile).
PAGE, PAGE_MULTIPLE = 128, 16
#: Keys per compute block (``pages_per_compute_block * PAGE``) at most.
COMPUTE_BLOCK = 512


@dataclasses.dataclass(frozen=True)
class _Plan:
    page: int
    pages_per_block: int
    scale: float
    softcap: float | None


def _page(kv_len: int) -> int | None:
    """The largest page (a multiple of `PAGE_MULTIPLE`, at most `PAGE`) that
    divides ``kv_len``, or None."""
    sizes = [p for p in range(PAGE_MULTIPLE, PAGE + 1, PAGE_MULTIPLE) if kv_len % p == 0]
    return max(sizes, default=None)


def _plan(spec: AttentionSpec) -> _Plan:
    form = _linear.linear_form(_util.without_lengths(spec))
    page = _page(spec.kv_len)
    pages = spec.kv_len // page
    fits = [d for d in range(1, pages + 1) if pages % d == 0 and d * page <= COMPUTE_BLOCK]
    return _Plan(page=page, pages_per_block=max(fits), scale=form.scale, softcap=form.softcap)


def _reasons(spec: AttentionSpec) -> list[str]:
    reasons = _util.input_reasons(spec, "paged attention")
    if reasons:
        return reasons
    if _util.kernel_dtype(spec) != _util.BF16:
        reasons.append(
            f"the paged decode kernel computes its products at the TPU's default matmul "
            f"precision (bfloat16 operands), but this attention keeps {spec.q_dtype.name} "
            "precision (q/k/v, weights or output); it takes bfloat16 attention: use "
            "'splash' or 'blockwise'"
        )
    if spec.q_len > MAX_QUERIES:
        reasons.append(
            f"{spec.q_len} queries per row: the paged kernel is the decode path (at most "
            f"{MAX_QUERIES} queries against a KV cache); 'splash' runs longer query blocks"
        )
    if spec.head_dim % _tpu.TPU_LANES or spec.v_head_dim != spec.head_dim:
        reasons.append(
            f"head dims {spec.head_dim} (k) and {spec.v_head_dim} (v): the paged kernel "
            f"needs one head dim, a multiple of {_tpu.TPU_LANES}, and padding would copy "
            "the whole cache at every step; 'blockwise' runs it"
        )
    if _page(spec.kv_len) is None:
        reasons.append(
            f"kv_len {spec.kv_len} is not a multiple of {PAGE_MULTIPLE}: the cache cannot be "
            "viewed as pages without copying it at every step; 'blockwise' runs it"
        )
    form = _linear.linear_form(_util.without_lengths(spec))
    reasons += form.reasons
    takes = "the paged kernel takes only per-row kv lengths and a soft-cap"
    if form.biases:
        reasons.append(f"an additive bias: {takes}; use 'splash' or 'blockwise'")
    for index in form.masks:
        if _util.is_key_mask(spec, index):
            reasons.append(f"a key mask (any set of keys, not a length): {takes}")
        else:
            reasons.append(f"a boolean mask that varies over queries: {takes}")
    if form.causal_offset is not None:
        reasons.append(
            f"a causal mask (offset {form.causal_offset}) that gives the {spec.q_len} "
            f"queries different key counts over kv_len={spec.kv_len}: the paged kernel "
            "takes one length per row, shared by its queries"
        )
    return reasons + _util.lengths_reasons(
        spec, "the paged kernel takes one length per batch row (and kv head)"
    )


def _with_reference_gradient(spec: AttentionSpec, kernel):
    """``kernel(q, k, v, *extras)`` whose reverse-mode gradient is the reference
    attention's (the Pallas call has none)."""

    def reference(q, k, v, *extras):
        return reference_attention(spec, q, k, v, extras)

    @jax.custom_vjp
    def call(*args):
        return kernel(*args)

    def fwd(*args):
        return kernel(*args), args

    def bwd(args, cotangent):
        return jax.vjp(reference, *args)[1](cotangent)

    call.defvjp(fwd, bwd)
    return call


class PagedTpuKernel(_tpu.TpuKernel):
    """JAX's paged-attention TPU kernel as the decode path: one to `MAX_QUERIES`
    queries per row against a contiguous KV cache with per-row lengths
    (``pallas.ops.tpu.paged_attention``; see the module docstring).

    Runs on TPU, or on CPU with ``interpret=True`` (slow; for tests).  Supports
    Scale, Softcap and `KvLengths` ops and GQA/MQA, bfloat16 only; its gradient
    is the reference attention's.
    """

    name = "paged_tpu"
    dtypes = frozenset({"bfloat16"})
    descriptors = frozenset({"softcap", "gqa", "kv_lengths"})
    spec_reasons = staticmethod(_reasons)

    def apply(self, spec: AttentionSpec, q, k, v, extras: Sequence = (), *, interpret=False):
        self.require(_reasons(spec))
        _util.check_arrays(self.name, spec, q, k, v, extras)
        plan = _plan(spec)
        pa = compat.tpu_paged_attention_module()
        B, Hkv, G, T = spec.batch, spec.kv_heads, spec.groups, spec.q_len
        D = spec.head_dim
        pages = spec.kv_len // plan.page
        # Static page table: sequence i = b*Hkv + h owns pages [i*pages, (i+1)*pages).
        table = np.arange(B * Hkv * pages, dtype=np.int32).reshape(B * Hkv, pages)
        kdt = _util.BF16

        def kernel(q, k, v, *extras):
            n = _util.valid_lengths(spec, extras)
            n = jnp.full((B,), spec.kv_len, jnp.int32) if n is None else jnp.broadcast_to(n, (B,))
            # The spec rounds q to its compute dtype; the scale is folded in float32.
            qs = q.astype(spec.compute_dtype).astype(jnp.float32) * jnp.float32(plan.scale)
            qs = qs.reshape(B, Hkv, G * T, D).reshape(B * Hkv, G * T, D)

            def paged(x):  # a view of the cache (a reshape, no copy)
                return x.astype(kdt).reshape(1, B * Hkv * pages, plan.page, D)

            with compat.pallas_tpu_context(interpret):
                out = pa.paged_attention(
                    qs,
                    paged(k.astype(spec.compute_dtype)),
                    paged(v),
                    jnp.repeat(n, Hkv),
                    jnp.asarray(table),
                    attn_logits_soft_cap=plan.softcap,
                    pages_per_compute_block=plan.pages_per_block,
                )
            out = out.reshape(B, Hkv, G, T, D).reshape(B, Hkv * G, T, D)
            out = out.astype(spec.out_dtype)
            return _util.fill_empty_rows(spec, out, v, (n == 0)[:, None, None, None])

        return _with_reference_gradient(spec, kernel)(q, k, v, *extras)
