"""Internal errors: the pass's own failures, kept apart from pattern reasons.

A site the pass *declines* (a pattern condition failed, no kernel fits) is an
ordinary fallback.  A site where the pass itself *crashed* (an exception in
the matcher, the sharding planner or the rewriter) is an internal error: the
original computation is kept, so the user's program still runs, but the
report lists it in a section of its own and the ``flashpass`` logger warns.

Under the strict switch (``FLASHPASS_STRICT=1`` in the environment, or
``optimize(..., strict=True)``) internal errors re-raise instead, so a test
suite can tell "declined" from "crashed".  flashpass's own tests run strict.
"""

from __future__ import annotations

import contextlib
import contextvars
import os

STRICT_ENV = "FLASHPASS_STRICT"

#: What the report and the warning tell the user to do about an internal error.
HOW_TO_REPORT = (
    "this is a flashpass bug, not a problem with your code: the site was kept as "
    "written; please report it with this message, report.to_json() and your JAX version "
    f"(set {STRICT_ENV}=1 to raise it with a traceback)"
)

#: The note added to JAX's error when an optimized function is differentiated
#: forward through a kernel whose backward is its own (a ``custom_vjp``).
FORWARD_MODE = (
    "flashpass: the rewritten attention runs a flash kernel with its own backward "
    "(a custom_vjp), which JAX differentiates in reverse mode only; for jax.jvp, "
    "jax.jacfwd or jax.linearize, optimize with kernel='chunked' (plain JAX, both "
    "modes, chunk x S memory) or call the original function"
)

_STRICT: contextvars.ContextVar[bool | None] = contextvars.ContextVar(
    "flashpass_strict", default=None
)


def strict() -> bool:
    """Whether internal errors re-raise (the `strict_mode` context, else the env var)."""
    value = _STRICT.get()
    if value is not None:
        return value
    return os.environ.get(STRICT_ENV, "").strip().lower() in ("1", "true", "yes", "on")


@contextlib.contextmanager
def strict_mode(enabled: bool | None):
    """Run the pass with internal errors re-raised (True), reported (False),
    or as the environment says (None)."""
    token = _STRICT.set(enabled)
    try:
        yield
    finally:
        _STRICT.reset(token)


def describe(err: BaseException) -> str:
    """``"TypeError: first line of the message"`` (bounded)."""
    message = (str(err).strip().splitlines() or [""])[0]
    return f"{type(err).__name__}: {message}"[:400]


class PlatformError(RuntimeError):
    """An optimized program was built for another platform than the one it is
    called on (``optimize(fn, platform="gpu")`` on a CPU host): its kernels
    cannot run here.  The message names both platforms and how to get a
    program that runs."""


def platform_mismatch(name: str, built_for: str, host: str, kernels: dict) -> PlatformError:
    """The error for calling ``name``, built for ``built_for``, on ``host``.

    ``kernels`` maps each kernel that cannot run here to whether
    ``interpret=True`` would let it (Pallas kernels in interpret mode).
    """
    names = ", ".join(sorted(kernels))
    ways = [f"optimize it for this host (platform={host!r}, or no platform=)"]
    if all(kernels.values()):
        ways.append(f"pass interpret=True to run {names} in interpret mode on {host} (slow)")
    return PlatformError(
        f"{name} was optimized for platform={built_for!r} and its attention runs {names}, "
        f"which cannot run on this {host} host. To run it here, " + ", or ".join(ways) + ". "
        "explain() still shows the program it builds."
    )
