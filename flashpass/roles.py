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


def role_name(role) -> str:
    """A role's name in reasons."""
    if isinstance(role, tuple):
        return f"batch axis {role[1]}"
    return {"G": "query group", "T": "query", "S": "key"}.get(role, str(role))
