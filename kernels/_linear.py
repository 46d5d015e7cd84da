"""The one form of library attention kernels, and a spec's rewrite into it.

Library kernels (splash, cuDNN, the Pallas GPU kernel, tokamax) compute::

    logits = C * (q @ k^T) + sum_i m_i * bias_i      (C: one scale)
    logits = cap * tanh(logits / cap)                (optional soft-cap)
    logits = where(keep, logits, very negative)      (masks, causal)
    out    = softmax(logits) @ v

`linear_form` rewrites a spec's ordered score ops into that form when it can,
exactly, and says in words why not when it cannot.  Moving a Scale that
follows a Softcap in front of it is exact algebra:
``c * cap * tanh(x / cap) == (c * cap) * tanh(c * x / (c * cap))``.
Structured masks (`ScoreOp.reason_words`) are kept for an adapter that maps
them to its own masks, else declined in their own words.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from flashpass.spec import (
    EXCLUDING_FILL,
    AttentionSpec,
    Bias,
    Causal,
    KvLengths,
    Mask,
    Scale,
    Sink,
    Softcap,
    excludes,
)

from ._util import input_reasons

#: Why a library adapter declines a `KvLengths` op (none declares "kv_lengths";
#: `linear_form` and the TPU flash adapter give it).
KV_LENGTHS_REASON = (
    "per-row kv lengths (a `j < lengths[b]` mask) are not supported by this kernel; "
    "the 'blockwise' kernel skips the blocks past each row's length"
)


#: Why a library adapter declines a `Sink` op (`linear_form` gives it, unless ``sinks``).
SINK_REASON = (
    "attention sinks (a per-row logit that joins the softmax's normaliser) are not "
    "supported by this kernel; the 'blockwise' kernel starts its online softmax from them"
)


@dataclasses.dataclass(frozen=True)
class LinearForm:
    """A spec as ``where(keep, softcap(scale * qk + sum(m * bias)), -big)``."""

    scale: float
    #: (extra index, multiplier): bias ``i`` enters the logits as ``m * extras[i]``.
    biases: tuple[tuple[int, float], ...]
    softcap: float | None
    #: extra indices of the boolean keep-masks.
    masks: tuple[int, ...]
    #: causal offset (keys ``j <= i + offset`` kept); None when no key is excluded.
    causal_offset: int | None
    #: why the spec does not have this form (empty: it does).
    reasons: tuple[str, ...]
    #: the structured ops (`Window`, `Chunk`, `Prefix`, `Segments`) the caller
    #: accepted (``linear_form(structured=...)``), checked to exclude keys.
    structured: tuple = ()


def exclusion_reasons(spec: AttentionSpec, position: int) -> list[str]:
    """Why the Mask or Causal op at ``position`` does not exclude keys the way a
    kernel's own masking does (exactly zero weight), or leaves rows empty."""
    op = spec.ops[position]
    reasons = []
    value = spec.final_fill(position, op.fill)
    if not excludes(value):
        kind = getattr(op, "reason_words", None) or (
            "mask" if isinstance(op, Mask) else "causal mask"
        )
        reasons.append(
            f"{kind} fill {op.fill} ends as score {value:.6g} after the ops that "
            f"follow it, which does not exclude keys (needs <= {EXCLUDING_FILL} or "
            "-inf; a soft-cap after the mask turns any fill into about -cap): masked "
            "keys would keep a non-zero weight; use a fill such as -1e9 or -inf "
            "applied after the soft-cap, or the 'blockwise' kernel"
        )
    if isinstance(op, Causal) and op.offset < 0:
        reasons.append(f"causal offset {op.offset} < 0 leaves query rows with no key to attend to")
    return reasons


def linear_form(
    spec: AttentionSpec, structured: frozenset = frozenset(), *, sinks: bool = False
) -> LinearForm:
    """Rewrite ``spec.ops`` as a `LinearForm` (see module doc); the
    structured op types in ``structured`` are kept (the caller maps them to
    its own masks) instead of rejected; with ``sinks`` the caller applies a
    `Sink` op itself (it is not part of the form)."""
    reasons: list[str] = []
    scale = 1.0
    biases: list[list] = []
    cap = None
    post = 1.0  # product of the Scales after the Softcap
    masks: list[int] = []
    offsets: list[int] = []
    kept: list = []
    for position, op in enumerate(spec.ops):
        if isinstance(op, Scale):
            if cap is None:
                scale *= op.value
                for b in biases:
                    b[1] *= op.value
            else:
                post *= op.value
        elif isinstance(op, Bias):
            if cap is not None:
                reasons.append(
                    "a bias added after the logit soft-cap is not supported (the kernel caps "
                    "the biased logits); add the bias before the soft-cap"
                )
            biases.append([op.index, 1.0])
        elif isinstance(op, Softcap):
            if cap is not None:
                reasons.append("two logit soft-caps in a row are not supported")
            elif not op.cap > 0:
                reasons.append(f"soft-cap {op.cap} is not positive")
            cap = op.cap
        elif isinstance(op, Mask | Causal):
            reasons += exclusion_reasons(spec, position)
            if isinstance(op, Mask):
                masks.append(op.index)
            elif op.offset >= 0:
                offsets.append(op.offset)
        elif isinstance(op, KvLengths):
            reasons.append(KV_LENGTHS_REASON)
        elif isinstance(op, Sink):
            if not sinks:  # (a caller that applies the sink itself says so)
                reasons.append(SINK_REASON)
        elif type(op) in structured:
            reasons += exclusion_reasons(spec, position)
            kept.append(op)
        elif getattr(op, "reason_words", None):
            missing = [r for r in structured_reasons(spec, structured) if r not in reasons]
            reasons += missing
        else:
            reasons.append(f"unknown score op {type(op).__name__}")
    if cap is not None and post != 1.0:
        # c * cap * tanh(x / cap) == (c * cap) * tanh(c * x / (c * cap))
        scale *= post
        for b in biases:
            b[1] *= post
        cap *= post
        if not cap > 0:
            reasons.append("a non-positive scale after the logit soft-cap is not supported")
    offset = min(offsets) if offsets else None
    if offset is not None and offset >= spec.kv_len - 1:
        offset = None  # every key j <= S - 1 <= i + offset: nothing is excluded
    return LinearForm(
        scale=float(scale),
        biases=tuple((i, float(m)) for i, m in biases),
        softcap=None if cap is None else float(cap),
        masks=tuple(masks),
        causal_offset=offset,
        reasons=tuple(reasons),
        structured=tuple(kept),
    )


def structured_reasons(spec: AttentionSpec, accepted: frozenset = frozenset()) -> list[str]:
    """One reason per structured-mask op (`Window`, `Chunk`, `Prefix`,
    `Segments`: the kinds with `ScoreOp.reason_words`) in ``spec`` whose type is
    not in ``accepted``."""
    found = {
        type(op)
        for op in spec.ops
        if getattr(op, "reason_words", None) and type(op) not in accepted
    }
    return [
        f"{kind.reason_words} is not supported by this kernel; the 'blockwise' "
        f"kernel {kind.reason_hint}"
        for kind in sorted(found, key=lambda k: k.__name__)
    ]


def linear_reasons(
    spec: AttentionSpec,
    kernel: str,
    *,
    bias_instead: str | None = None,
    structured: frozenset = frozenset(),
    sinks: bool = False,
):
    """``(reasons, form)`` of an adapter built on `linear_form`: `input_reasons`,
    then (if there are none) the spec's `LinearForm` and its reasons.  With
    ``bias_instead`` the kernel takes no bias, and the reason names that kernel
    instead.  ``form`` is None when the inputs fail (it would read missing extras).
    ``structured``, ``sinks``: what the caller takes itself (`linear_form`)."""
    reasons = input_reasons(spec, kernel)
    if reasons:
        return reasons, None
    form = linear_form(spec, structured, sinks=sinks)
    reasons = list(form.reasons)
    if bias_instead is not None and form.biases:
        reasons.append(
            f"{kernel} takes no bias (additive mask or position bias); use the "
            f"'{bias_instead}' kernel, which adds biases, or 'blockwise'"
        )
    return reasons, form


def bias_sum(spec: AttentionSpec, form: LinearForm, extras, dtype):
    """``sum_i m_i * bias_i`` in ``dtype`` (broadcast shapes kept), or None.

    Each bias is rounded to the spec's compute dtype first, as the spec adds it.
    """
    total = None
    for index, multiplier in form.biases:
        bias = extras[index].astype(spec.compute_dtype).astype(dtype)
        if multiplier != 1.0:
            bias = bias * jnp.asarray(multiplier, dtype)
        total = bias if total is None else total + bias
    return total
