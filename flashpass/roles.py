"""Axis roles of the score layout that the matcher and the engine share.

A score axis has a role: a batch role (``("batch", i)``), a head or group
role, ``"T"`` (queries) or ``"S"`` (keys); `UNIT` marks an added size-1 axis,
and `Merged` an axis that holds several batch/group roles (see
patterns/regroup.py, which proves such reshapes).
"""

from __future__ import annotations

import dataclasses

#: Role of a size-1 axis a reshape added (or a unit axis of the output).
UNIT = "unit"


@dataclasses.dataclass(frozen=True)
class Merged:
    """Role of an axis that holds several batch/group roles, major first."""

    parts: tuple  # ((role, size), ...), every size > 1

    def __str__(self) -> str:
        return "×".join(role_name(r) for r, _ in self.parts)


def parts(role) -> list:
    """The roles an axis holds: a `Merged` axis's parts, else the role itself."""
    return [p for p, _ in role.parts] if isinstance(role, Merged) else [role]


def flat(roles) -> list:
    """``roles`` with every `Merged` role replaced by its parts, in order."""
    return [p for r in roles for p in parts(r)]


def score_batch_roles(n_batch: int, splits: dict) -> list:
    """The role of each batch axis of a score product: ``("batch", i)``, or a
    `Merged` of consecutive batch roles where ``splits`` gives the axis' factors
    (major first): PyTorch's ``bmm`` on ``[B·H, T, D]`` operands whose scores are
    then viewed as ``[B, H, T, S]``.  Batch roles are numbered across all axes,
    so the canonical layout sees every factor as a batch axis of its own."""
    out, n = [], 0
    for i in range(n_batch):
        sizes = splits.get(i, ())
        if len(sizes) > 1:
            out.append(Merged(tuple((("b", n + j), s) for j, s in enumerate(sizes))))
            n += len(sizes)
        else:
            out.append(("b", n))
            n += 1
    return out


def role_name(role) -> str:
    """A role's name in reasons."""
    if isinstance(role, Merged):
        return f"merged axis {role}"
    if isinstance(role, tuple):
        return f"batch axis {role[1]}"
    return {"G": "query group", "T": "query", "S": "key"}.get(role, str(role))
