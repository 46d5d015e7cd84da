"""The kernel contract: the `Kernel` base class and its `CheckContext`.

Kernels receive one canonical `AttentionSpec` per attention site; the spec,
its score ops and their exact semantics live in the engine (`flashpass.spec`)
and are re-exported by `flashpass.kernels`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import ClassVar

from flashpass.spec import DESCRIPTORS, FLOAT_DTYPES, AttentionSpec

# --------------------------------------------------------------------------- kernels


@dataclasses.dataclass(frozen=True)
class CheckContext:
    """What a kernel's `check` may consult besides the spec.

    ``explicit`` is True when the user named this kernel: cost heuristics
    (e.g. "sequence too short to pay off") must then not reject the site.
    ``kv_layout`` is how the program holds k and v (`Kernel.kv_layouts`), for
    cost models whose crossover depends on it.
    """

    platform: str
    interpret: bool = False
    explicit: bool = False
    kv_layout: str = "bhsd"


class Kernel:
    """Base class of kernel adapters.  Subclasses set the class attributes
    and implement `check` and `apply`.

    The capability attributes below are the kernel's declarations, in one
    place: sharding (`partitionable`, `plain_jax`), the conformance suite
    (every capability against `check`) and the matrix in docs/kernels.md
    (`flashpass.kernels.matrix`) read them.  `check` stays the authority for
    a given spec (it also knows limits no capability names, e.g. head dims);
    it must reject what the declarations leave out.
    """

    #: Registry name, also used in the ``flashpass_<name>`` call in rewritten jaxprs.
    name: ClassVar[str] = ""
    #: Platforms the kernel runs on natively ("cpu", "gpu", "tpu").
    platforms: ClassVar[tuple[str, ...]] = ()
    #: Platforms on which ``interpret=True`` lets it run (e.g. a TPU kernel on CPU).
    interpret_platforms: ClassVar[tuple[str, ...]] = ()
    #: Dtypes (names) of the attention it computes: q, k, v, weights and output in
    #: one of them.  A spec mixing dtypes is `check`'s call.
    dtypes: ClassVar[frozenset[str]] = FLOAT_DTYPES
    #: The spec descriptors it accepts (`flashpass.spec.DESCRIPTORS`; see
    #: `AttentionSpec.descriptors`).
    descriptors: ClassVar[frozenset[str]] = frozenset(DESCRIPTORS)
    #: Whether it has reverse-mode gradients (a ``custom_vjp`` or differentiable
    #: code).  Selection reads it where the program differentiates the site (a
    #: training step: its backward is replaced by the kernel's) and for ring
    #: steps; a forward-only site may take a kernel without gradients, and
    #: differentiating that one later raises JAX's error.
    grad: ClassVar[bool] = True
    #: Whether XLA's SPMD partitioner can split it along batch and heads (plain
    #: JAX, or a ``custom_partitioning`` rule): usable on meshes with Auto axes.
    partitionable: ClassVar[bool] = False
    #: Whether it is plain JAX: it type-checks inside a ``shard_map`` body with
    #: ``check_vma=True`` (a Pallas call does not declare varying axes).
    plain_jax: ClassVar[bool] = False
    #: Whether it computes dropout on the weights exactly: the program's own
    #: keep-mask, regenerated from its key (`flashpass.spec.Dropout`).  Selection
    #: skips a kernel without it for a site with dropout, with the reason.
    dropout: ClassVar[bool] = False
    #: Whether it runs one step of a ring (context-parallel) attention: a
    #: query block against a visiting K/V block, returning the row statistics
    #: the ring merges by (`step_forward`), and the block's share of the
    #: gradients from the global statistics (`step_backward`).  The ring asks
    #: `check` about each step's own spec (`flashpass.ring.cases`).
    ring_step: ClassVar[bool] = False
    #: The K/V layouts ``apply`` reads as given (its ``kv_layout=`` argument):
    #: ``"bhsd"`` (canonical ``[B, Hkv, S, D]``) always; ``"bshd"``
    #: (``[B, S, Hkv, D]``, a cache as most models hold it) where declared.  A
    #: site whose program holds K/V in a declared layout passes them as they
    #: are; any other is transposed to the canonical layout for the call.
    kv_layouts: ClassVar[tuple[str, ...]] = ("bhsd",)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        # A subclass written against the old name declares `supports_grad`.
        if "supports_grad" in cls.__dict__ and "grad" not in cls.__dict__:
            cls.grad = bool(cls.__dict__["supports_grad"])

    @property
    def supports_grad(self) -> bool:
        """The old name of `grad`."""
        return self.grad

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

    def step_reasons(self, spec: AttentionSpec) -> list[str]:
        """Why the kernel cannot run ``spec`` as a ring step, beyond `check`
        (which the ring also asks): limits of its step path alone."""
        return [] if self.ring_step else [f"{self.name} does not run ring steps"]

    def step_forward(self, spec: AttentionSpec, q, k, v, extras=(), *, interpret: bool = False):
        """One ring step (kernels declaring `ring_step`): ``(out, m, den)``,
        the block's normalised output ``[B, H, T, Dv]`` (``spec.out_dtype``,
        float32 in a ring) and its row max ``m`` and row sum ``den`` of
        ``exp(s - m)``, each ``[B, H, T]`` float32.  A row every key of which a
        fill replaced has ``m`` = that fill (the ring then averages them as the
        original does); one whose keys are all ``-inf`` has ``den`` 0."""
        raise NotImplementedError(f"{self.name} does not run ring steps")

    def step_backward(
        self,
        spec: AttentionSpec,
        q,
        k,
        v,
        extras,
        out,
        m,
        den,
        dout,
        wanted,
        *,
        interpret: bool = False,
    ):
        """The block's share of the gradients: ``(dq, dk, dv, dextras)``, the
        arrays in float32 (the ring sums the shares before casting), with
        the weights ``exp(s - m) / den`` of the *global* statistics ``m`` and
        ``den`` (``[B, H, T]``, every row's ``den > 0``) and the global output
        ``out`` (``delta = rowsum(dout * out)``).  ``wanted[i]``: whether
        ``extras[i]`` (a bias) needs its cotangent (else None)."""
        raise NotImplementedError(f"{self.name} does not run ring steps")

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


class PlainJaxKernel(Kernel):
    """Base of the kernels written in plain JAX that implement every spec
    (``blockwise``, ``reference``): they run on every platform in any float
    dtype, JAX differentiates them (or their own ``custom_vjp``), XLA's SPMD
    partitioner splits them, and they type-check inside ``shard_map``."""

    platforms = ("cpu", "gpu", "tpu")
    dtypes = FLOAT_DTYPES
    descriptors = frozenset(DESCRIPTORS)
    grad = True
    partitionable = True
    plain_jax = True
