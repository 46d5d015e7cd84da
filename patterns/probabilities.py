"""Between the softmax and ``P·V``: casts, transposes, head masks, dropout.

* ``p.astype(v.dtype)`` (mixed precision) and transposes are layout only.
* ``p * m`` or ``p / m`` where ``m`` is constant along the key axis (Hugging
  Face's ``layer_head_mask``, a per-head or per-query scale): since
  ``(m * P) V == m * (P V)``, it is applied to the kernel output.
* Dropout on the probabilities (``where(bernoulli(...), p / keep, 0)``) is
  recognised and reported, never rewritten: a kernel would draw a different
  random stream.  Run the model deterministically (``deterministic=True``,
  ``dropout_rate=0``) for the rewrite.
"""

from __future__ import annotations

import dataclasses

from flashpass.graph import Scope

from .common import ESCAPE_HINT, Miss, profile, where

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


@dataclasses.dataclass
class ProbabilityPath:
    atom: object  # the value that enters P·V
    roles: list  # its axis roles
    nodes: set  # recognised equations on the way
    scales: list  # (Profile, roles at that point, invert): output multipliers
    consumer: tuple  # (node, operand position) of the P·V candidate


def walk_probabilities(scope: Scope, p, roles: list, ignore=frozenset()) -> ProbabilityPath | Miss:
    """Follow the probabilities ``p`` forward to the equation that consumes them."""
    nodes: set = set()
    scales: list = []
    atom = p
    roles = list(roles)
    while True:
        users = [u for u in scope.consumers(atom) if u[0] not in ignore]
        if scope.is_output(atom) or len(users) != 1:
            node = scope.producer(atom)
            what = (
                "returned by the function"
                if scope.is_output(atom)
                else f"used {len(users)} times, expected only by the P·V product"
            )
            return Miss(f"the attention probabilities{where(node)} are {what}{ESCAPE_HINT}", node)
        node, pos = users[0]
        if node.prim == "convert_element_type":
            nodes.add(node)
            atom = node.out
            continue
        if node.prim == "transpose":
            roles = [roles[i] for i in node.params["permutation"]]
            nodes.add(node)
            atom = node.out
            continue
        if node.prim == "select_n" and _is_random(scope, node.ins[0]):
            return Miss(
                f"dropout on the attention probabilities{where(node)}: not rewritten, a kernel "
                "would draw a different random stream; run deterministically (e.g. "
                "deterministic=True or dropout_rate=0) to rewrite this site",
                node,
            )
        if node.prim in ("mul", "div") and (node.prim == "mul" or pos == 0):
            other = node.ins[1 - pos]
            if _is_random(scope, other):
                return Miss(f"dropout on the attention probabilities{where(node)}", node)
            prof = profile(scope, other, scope.shape(node.out))
            if prof.axes[roles.index("S")] is not None:
                return Miss(
                    f"the probabilities are scaled by a tensor that varies along the key "
                    f"axis{where(node)}",
                    node,
                )
            scales.append((prof, list(roles), node.prim == "div"))
            nodes.add(node)
            atom = node.out
            continue
        return ProbabilityPath(atom, roles, nodes, scales, (node, pos))


def _is_random(scope: Scope, atom) -> bool:
    return any(n.prim in RANDOM_PRIMS for n in scope.backward_cone([atom]))
