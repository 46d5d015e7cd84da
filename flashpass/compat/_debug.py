"""Trace-time names: errors raised while tracing name the user's function.

The pass traces ``fn`` through a wrapper over the flat argument leaves.  JAX
names the traced function and its arguments in tracing errors ("while tracing
the function f at file:line ... the argument q[0]") from the debug info of the
function it traces; the wrapper carries the user's function's instead
(``jax._src.api_util``, private).
"""

from __future__ import annotations

from jax._src import api_util


def trace_as(wrapper, fn, args, kwargs, static_argnums, static_argnames, num_leaves) -> None:
    """Make tracing errors in ``wrapper`` (over ``num_leaves`` flat leaves) name
    ``fn`` and the path of each argument leaf, as ``jax.jit`` of ``fn`` would.

    ``args``/``kwargs`` are the full call's (static ones included).  Nothing
    changes when the names do not line up with the leaves.
    """
    info = api_util.debug_info(
        "flashpass.optimize",
        fn,
        args,
        kwargs,
        static_argnums=tuple(static_argnums),
        static_argnames=tuple(static_argnames),
    )
    if info.arg_names is not None and len(info.arg_names) == num_leaves:
        api_util.save_wrapped_fun_debug_info(wrapper, info)


def name_stack(eqn) -> str:
    """The JAX name stack an equation was traced under (``jax.named_scope``,
    Flax module paths), e.g. ``"Model/decoder/layers_3/attn/jvp(attn)"``."""
    return str(eqn.source_info.name_stack)
