"""The kernel contract: the `Kernel` base class and its `CheckContext`.

Kernels receive one canonical `AttentionSpec` per attention site; the spec,
its score ops and their exact semantics live in the engine (`flashpass.spec`)
and are re-exported here and by `flashpass.kernels`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import ClassVar

from flashpass.spec import (
    EXCLUDING_FILL,
    AttentionSpec,
    Bias,
    Causal,
    ExtraSpec,
    Mask,
    Scale,
    ScoreOp,
    Softcap,
)

__all__ = [
    "EXCLUDING_FILL",
    "AttentionSpec",
    "Bias",
    "Causal",
    "CheckContext",
    "ExtraSpec",
    "Kernel",
    "Mask",
    "Scale",
    "ScoreOp",
    "Softcap",
]


# --------------------------------------------------------------------------- kernels


@dataclasses.dataclass(frozen=True)
class CheckContext:
    """What a kernel's `check` may consult besides the spec.

    ``explicit`` is True when the user named this kernel: cost heuristics
    (e.g. "sequence too short to pay off") must then not reject the site.
    """

    platform: str
    interpret: bool = False
    explicit: bool = False


class Kernel:
    """Base class of kernel adapters.  Subclasses set the class attributes
    and implement `check` and `apply`."""

    #: Registry name, also used in the ``flashpass_<name>`` call in rewritten jaxprs.
    name: ClassVar[str] = ""
    #: Platforms the kernel runs on natively ("cpu", "gpu", "tpu").
    platforms: ClassVar[tuple[str, ...]] = ()
    #: Platforms on which ``interpret=True`` lets it run (e.g. a TPU kernel on CPU).
    interpret_platforms: ClassVar[tuple[str, ...]] = ()
    #: Whether the kernel has a gradient (a ``custom_vjp`` or differentiable code).
    supports_grad: ClassVar[bool] = True

    def check(self, spec: AttentionSpec, ctx: CheckContext) -> list[str]:
        """Return the reasons this kernel cannot run ``spec`` (empty: it can).

        Must not execute anything; it only inspects static information.
        """
        raise NotImplementedError

    def apply(
        self,
        spec: AttentionSpec,
        q,
        k,
        v,
        extras: Sequence = (),
        *,
        interpret: bool = False,
    ):
        """Compute the attention output ``[B, H, T, Dv]`` in ``spec.out_dtype``."""
        raise NotImplementedError

    def platform_reasons(self, ctx: CheckContext) -> list[str]:
        """Shared helper: reject platforms the kernel cannot run on."""
        if ctx.platform in self.platforms:
            return []
        if ctx.interpret and ctx.platform in self.interpret_platforms:
            return []
        hint = ""
        if ctx.platform in self.interpret_platforms:
            hint = " (pass interpret=True to run it in interpret mode)"
        return [f"{self.name} runs on {', '.join(self.platforms)}, not {ctx.platform}{hint}"]

    def require(self, reasons: list[str]) -> None:
        """Shared helper for `apply`: raise when ``reasons`` (from `check`'s
        spec checks) say this kernel cannot run the attention."""
        if reasons:
            raise ValueError(f"{self.name} cannot run this attention: " + "; ".join(reasons))

    def __repr__(self) -> str:
        return f"<flashpass kernel {self.name!r}>"
