"""Between the softmax and ``P·V``: casts, transposes, head masks, dropout.

* ``p.astype(v.dtype)`` (mixed precision), copies and transposes are layout only.
* ``where(m, p, 0)`` with ``m`` proven to keep exactly what the scores' masks
  keep (Keras' masked softmax, with the mask split into factors on the scores).
* ``p * m`` or ``p / m`` where ``m`` is constant along the key axis (Hugging
  Face's ``layer_head_mask``, a per-head or per-query scale): since
  ``(m * P) V == m * (P V)``, it is applied to the kernel output.
* Dropout on the probabilities (``where(bernoulli(...), p / keep, 0)``, flax's
  ``p * (keep / keep_prob)``, ...) becomes a `Dropout` op (`dropout`): the
  kernel regenerates the program's own keep-mask from its key.  Where that
  cannot be exact (a non-threefry PRNG, non-partitionable threefry) the site
  is kept and the report says why.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from flashpass import compat
from flashpass.graph import Scope
from flashpass.site import ExtraSource, OutputScale, RowKeep

from .common import ESCAPE_HINT, Miss, profile, scalar_value, where
from .dropout import dropout_op, match_dropout
from .regroup import PRIMS as REGROUP_PRIMS
from .regroup import UNIT, regroup
from .softmax import safe_softmax_guard

#: Primitives whose presence marks a value as random (dropout masks).
RANDOM_PRIMS = frozenset(
    {
        "random_bits",
        "random_wrap",
        "random_seed",
        "threefry2x32",
        "rng_bit_generator",
        "rng_uniform",
        "random_fold_in",
    }
)


#: Value-preserving ops between the probabilities and ``P·V`` (penzai's
#: named-axis arrays copy them).
VALUE_PRESERVING = frozenset({"copy", "copy_p", *compat.VALUE_IDENTITY_PRIMITIVES})


def _is_float(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.floating)


@dataclasses.dataclass(frozen=True)
class ScaleAfter:
    """``p * m`` or ``p / m`` (``invert``) with ``m`` constant along the keys:
    an output multiplier (`OutputScale`)."""

    base: object
    axes: dict  # role -> axis of ``base``
    invert: bool

    def apply(self, scope: Scope, layout, ops, extras):
        dtype = scope.dtype(self.base)
        return OutputScale(ExtraSource(self.base, self.axes, None, dtype), self.invert), ops, extras


@dataclasses.dataclass(frozen=True)
class RowKeepAfter:
    """The rows a mask empties zeroed again after the softmax (`RowKeep`)."""

    def apply(self, scope: Scope, layout, ops, extras):
        return RowKeep(), ops, extras


@dataclasses.dataclass(frozen=True)
class DropoutAfter:
    """Dropout on the probabilities: the spec's `Dropout`, its key an extra."""

    found: object  # `dropout.FoundDropout`

    def apply(self, scope: Scope, layout, ops, extras):
        op, key = dropout_op(self.found, layout, len(extras))
        return None, [*ops, op], [*extras, key]


@dataclasses.dataclass
class ProbabilityPath:
    atom: object  # the value that enters P·V
    roles: list  # its axis roles
    nodes: set  # recognised equations on the way
    #: The typed steps between the softmax and P·V, in program order; each
    #: ``apply(scope, layout, ops, extras)`` gives ``(site step or None, ops,
    #: extras)`` (`match._after_softmax`).
    post: list
    consumer: tuple  # (node, operand position) of the P·V candidate


@dataclasses.dataclass(frozen=True)
class ScoreMasks:
    """The masks applied to the scores: ``(MaskStep, roles at that step)`` pairs,
    and whether every key-excluding score op came from one of them with a fill
    that still excludes after the later ops (so excluded keys weigh exactly 0)."""

    steps: tuple = ()
    exact: bool = False
    #: "end"/"start": the scores carry a sink column there (`patterns.sinks`),
    #: which a ``slice`` must drop before ``P·V``.
    sink: str | None = None
    #: The final score of every key-excluding op (its fill after later ops).
    final_fills: tuple = ()
    #: Whether a dense bias is added to the scores (its values may be ``-inf``).
    dense_bias: bool = False


def _factor_keys(scope: Scope, prof, roles, keep_when: bool):
    """The factors of a boolean mask `Profile` as comparable keys: a constant
    causal factor by its offset, any other by its atom, axis roles and polarity.
    Factors that keep everything are left out; None if one is not a mask."""
    from .masks import and_factors, classify  # masks imports the chain: not at module level

    keys = set()
    for factor in and_factors(scope, prof):
        kind = classify(scope, factor, roles, keep_when=keep_when, fill=float("-inf"))
        if kind == "all":
            continue
        if kind is not None:  # a Causal op: by value, however it is spelled
            keys.add(("causal", kind.offset))
            continue
        axes = tuple(
            sorted(((roles[t], a) for t, a in enumerate(factor.axes) if a is not None), key=str)
        )
        keys.add((scope.resolve(factor.base), axes, keep_when))
    return keys


def walk_probabilities(
    scope: Scope, p, roles: list, ignore=frozenset(), masks=ScoreMasks(), outputs_ok=False
) -> ProbabilityPath | Miss:
    """Follow the probabilities ``p`` forward to the equation that consumes them.

    ``where(mask, p, 0)`` with a mask that already masked the scores (Keras'
    masked softmax) changes only fully masked rows, to zero: a causal mask has
    none (dropped), a mask array becomes "zero the rows with no kept key".
    """
    nodes: set = set()
    post: list = []
    atom = p
    roles = list(roles)
    sink = masks.sink  # still to be sliced off
    while True:
        users = [u for u in scope.consumers(atom) if u[0] not in ignore]
        # ``outputs_ok``: a returned value is left to the escape check (match.py),
        # e.g. a loop body's output autodiff saves for the backward loop.
        if (scope.is_output(atom) and not outputs_ok) or len(users) != 1:
            node = scope.producer(atom)
            what = (
                "returned by the function"
                if scope.is_output(atom)
                else f"used {len(users)} times, expected only by the P·V product"
            )
            readers = tuple(u for u, _ in users)
            return Miss(
                f"the attention probabilities{where(node)} are {what}{ESCAPE_HINT}",
                node,
                readers=readers,
            )
        node, pos = users[0]
        if node.prim in VALUE_PRESERVING or (
            node.prim == "convert_element_type" and _is_float(scope.dtype(node.out))
        ):
            nodes.add(node)
            atom = node.out
            continue
        if node.prim == "transpose":
            roles = [roles[i] for i in node.params["permutation"]]
            nodes.add(node)
            atom = node.out
            continue
        if node.prim == "slice" and sink is not None:
            if not _drops_sink(node, scope.shape(atom), roles.index("S"), sink):
                return Miss(
                    f"the probabilities are sliced other than to drop the sink column{where(node)}",
                    node,
                )
            sink = None
            nodes.add(node)
            atom = node.out
            continue
        if sink is not None:
            return Miss(
                f"the probabilities keep the sink column on the way to `{node.prim}` (it "
                f"must be sliced off before P·V){where(node)}",
                node,
            )
        if node.prim in REGROUP_PRIMS and pos == 0 and len(node.ins) == 1:
            new = regroup(node, roles, scope.shape(atom), scope.shape(node.out))
            if isinstance(new, str):
                return Miss(f"`{node.prim}` of the probabilities {new}{where(node)}", node)
            roles = new
            nodes.add(node)
            atom = node.out
            continue
        if node.prim == "select_n" and not _is_random(scope, node.ins[0]):
            guard = safe_softmax_guard(scope, node, pos)
            if isinstance(guard, Miss):
                return guard
            nodes |= guard
            remask = (
                _guarded_rows(node, masks) if guard else _remask(scope, node, pos, roles, masks)
            )
            if isinstance(remask, Miss):
                return remask
            if remask != "noop":
                post.append(RowKeepAfter())
            nodes.add(node)
            atom = node.out
            continue
        if node.prim == "dot_general" and _is_batch_scale(scope, node, pos, roles):
            other, m_axes, roles = _batch_scale(scope, node, pos, roles)
            post.append(ScaleAfter(other, m_axes, False))
            nodes.add(node)
            atom = node.out
            continue
        random = (node.prim == "select_n" and _is_random(scope, node.ins[0])) or (
            node.prim in ("mul", "div") and _is_random(scope, node.ins[1 - pos])
        )
        if random:
            found = _dropout(scope, node, pos, roles, post)
            if isinstance(found, Miss):
                return found
            post.append(DropoutAfter(found))
            nodes.add(node)
            atom = node.out
            continue
        if node.prim in ("mul", "div") and (node.prim == "mul" or pos == 0):
            other = node.ins[1 - pos]
            prof = profile(scope, other, scope.shape(node.out))
            if prof.axes[roles.index("S")] is not None:
                return Miss(
                    f"the probabilities are scaled by a tensor that varies along the key "
                    f"axis{where(node)}; scale v by it instead (P·(w·v) is the same product), "
                    "or, for a per-key weight of the softmax, add its log to the scores",
                    node,
                )
            axes = {r: a for r, a in zip(roles, prof.axes, strict=True) if r != UNIT}
            post.append(ScaleAfter(prof.base, axes, node.prim == "div"))
            nodes.add(node)
            atom = node.out
            continue
        return ProbabilityPath(atom, roles, nodes, post, (node, pos))


def _drops_sink(node, shape, axis: int, at: str) -> bool:
    """Whether the ``slice`` ``node`` of an array of ``shape`` keeps everything
    but the sink column at ``at`` ("end"/"start") of ``axis``."""
    strides = node.params.get("strides")
    if strides is not None and any(s != 1 for s in strides):
        return False
    start, limit = node.params["start_indices"], node.params["limit_indices"]
    keep = (0, shape[axis] - 1) if at == "end" else (1, shape[axis])
    return all(
        (start[a], limit[a]) == (keep if a == axis else (0, shape[a])) for a in range(len(shape))
    )


def _dropout(scope: Scope, node, pos: int, roles: list, post: list):
    """The dropout at ``node`` (`dropout.match_dropout`), or why it is kept."""
    if node.prim == "div" or (node.prim == "select_n" and pos == 0):
        return Miss(f"random values divide the attention probabilities{where(node)}", node)
    if any(isinstance(step, DropoutAfter) for step in post):
        return Miss(f"a second dropout on the attention probabilities{where(node)}", node)
    return match_dropout(scope, node, pos, roles)


def _is_random(scope: Scope, atom) -> bool:
    """Whether ``atom`` depends on a random-number primitive (memoised per scope)."""
    memo = scope.__dict__.setdefault("_random_memo", {})
    stack, order = [scope.resolve(atom)], []
    while stack:  # iterative DFS; results are filled in post-order below
        key = stack.pop()
        node = scope.producer(key)
        if node is None or node in memo:
            continue
        memo[node] = None  # in progress
        order.append(node)
        stack.extend(a for a in node.ins if scope.producer(a) is not None)
    for node in reversed(order):
        memo[node] = node.prim in RANDOM_PRIMS or any(
            memo.get(scope.producer(a)) for a in node.ins if scope.producer(a) is not None
        )
    node = scope.producer(atom)
    return bool(node is not None and memo.get(node))


def _remask(scope: Scope, node, pos: int, roles: list, masks: ScoreMasks):
    """ "noop", "rows" (zero the rows the score masks exclude entirely) or a Miss.

    ``where(m, p, 0)`` is proven, not assumed: ``m`` must keep exactly what the
    scores' masks keep (the same factors, compared by atom or, for constant
    causal factors, by value).  Then every key it zeroes already has weight 0,
    except in rows the scores' masks exclude entirely, which it zeroes."""
    pred, *cases = node.ins
    if len(cases) != 2 or pos == 0:
        return Miss(f"`select_n` on the attention probabilities{where(node)}", node)
    shape = scope.shape(node.out)
    other = profile(scope, cases[2 - pos], shape)
    if not other.is_scalar or scalar_value(scope, other.base) != 0.0:
        return Miss(f"the probabilities are replaced by a non-zero value{where(node)}", node)
    keep_when = pos == 2  # select_n picks cases[pred]; p is case pos-1
    wanted = _factor_keys(scope, profile(scope, pred, shape), roles, keep_when)
    have = set()
    for step, step_roles in masks.steps:
        have |= _factor_keys(scope, step.profile, step_roles, step.keep_when)
    if wanted != have:
        return Miss(
            f"the probabilities are masked by a mask that did not mask the scores{where(node)}; "
            "mask the scores before the softmax instead (`jnp.where(mask, s, -jnp.inf)`), "
            "which also renormalises each row (the weights masked after it do not sum to 1)",
            node,
        )
    if not masks.exact:
        return Miss(f"probabilities re-masked after a non-excluding mask{where(node)}", node)
    # Causal factors alone keep key 0 in every row: no row is fully masked.
    return "noop" if all(k[0] == "causal" for k in have) else "rows"


def _guarded_rows(node, masks: ScoreMasks):
    """What PyTorch's safe-softmax guard zeroes, in terms of the score ops.

    It zeroes the rows whose final scores are all ``-inf``.  Scores are finite
    except where a key-excluding op put its fill (the assumption the masks'
    fills already make), so: no ``-inf`` fill, no such row ("noop"); every
    fill ``-inf``, exactly the rows the ops exclude entirely ("rows").  A
    dense bias may hold ``-inf`` itself and a mix of fills is not one of the
    two: those sites are kept."""
    if masks.dense_bias:
        return Miss(
            "the safe-softmax guard follows a dense score bias, which may itself hold "
            f"-inf{where(node)}",
            node,
        )
    fills = set(masks.final_fills)
    if all(np.isfinite(f) for f in fills):
        return "noop"
    if fills == {float("-inf")}:
        return "rows"
    return Miss(
        f"the safe-softmax guard follows masks with both -inf and finite fills{where(node)}",
        node,
    )


def _is_batch_scale(scope: Scope, node, pos: int, roles: list) -> bool:
    """A ``dot_general`` contracting nothing whose other operand only has batch
    axes paired with non-key axes of ``p`` (BERT's ``einsum("...hqk,h->...hqk")``)."""
    (lc, rc), (lb, rb) = node.params["dimension_numbers"]
    if lc or rc:
        return False
    pb, ob = (lb, rb) if pos == 0 else (rb, lb)
    other = node.ins[1 - pos]
    if len(ob) != len(scope.shape(other)):
        return False
    return all(roles[a] != "S" for a in pb)


def _batch_scale(scope: Scope, node, pos: int, roles: list):
    (_, _), (lb, rb) = node.params["dimension_numbers"]
    pb, ob = (lb, rb) if pos == 0 else (rb, lb)
    other = node.ins[1 - pos]
    m_axes = {roles[a]: o for a, o in zip(pb, ob, strict=True)}
    free = [a for a in range(len(roles)) if a not in pb]
    new_roles = [roles[a] for a in pb] + [roles[a] for a in free]
    return other, m_axes, new_roles
