"""Flax NNX modules and optimizers as arguments: in-place updates kept.

A step written the NNX way (``optimizer.update(model, grads)``) updates the
variables of its argument objects in place.  ``optimize`` traces through its
own ``jax.jit``, which would drop those updates, so, as ``nnx.jit`` does, the
graph nodes among the arguments are split to their pure state before the
call, merged into fresh nodes inside the traced function, and the state they
end with is returned and written back into the caller's nodes.

This holds whichever way the step is wrapped: ``nnx.jit(optimize(step))``
(the nodes hold ``nnx.jit``'s tracers; their state is written back on its
trace) and ``optimize(nnx.jit(step))`` (the fresh nodes are ``nnx.jit``'s
arguments; it updates them, and their state is returned).

`Routes` sends an optimized function's calls that hold graph nodes to the
optimized pure function of their state.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import threading

import jax

from . import compat


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class _Slot:
    """Where the ``index``-th graph node sat in the arguments (no leaves)."""

    index: int


@dataclasses.dataclass
class Split:
    """One call's arguments with their graph nodes taken out."""

    graphdef: object  # hashable: a static argument of the pure function
    state: object  # a pytree of arrays
    args: tuple  # the arguments, each graph node replaced by a `_Slot`
    kwargs: dict
    nodes: tuple  # the caller's nodes, in slot order


class Routes:
    """An optimized function's calls with Flax NNX graph nodes among their
    arguments, routed to one optimized pure function of their state
    (`pure_function` of ``fn``), made on the first such call."""

    def __init__(self, fn, static_argnums, static_argnames):
        self._fn = fn
        self._nums, self._names = static_argnums, static_argnames
        self._lock = threading.Lock()
        self.optimized = None  # the pure function's optimized function, once made

    def __call__(self, args, kwargs, derive):
        """``(optimized, args, kwargs, split)`` for a call whose arguments hold
        graph nodes (the pure function's, its arguments, and the split to write
        the final state back through), or None when they hold none.

        ``derive(fn, static_argnums, static_argnames)`` makes the optimized
        function of the pure function, with the caller's settings.
        """
        split = split_call(args, kwargs, self._nums, self._names)
        if split is None:
            return None
        with self._lock:
            if self.optimized is None:
                # (graphdef, state) come first: the static positions shift by two.
                nums = (0, *(i + 2 for i in self._nums))
                self.optimized = derive(pure_function(self._fn), nums, tuple(self._names))
        pure_args = (split.graphdef, split.state, *split.args)
        return self.optimized, pure_args, split.kwargs, split


def split_call(args, kwargs, static_argnums, static_argnames) -> Split | None:
    """The call's graph nodes split off, or None when it has none.

    Static arguments are left alone (they are part of the cache key).
    """
    if not compat.nnx_loaded():
        return None
    nodes: list = []
    ids: dict[int, int] = {}  # one slot per node object, however often it is passed

    def take(x):
        if not compat.is_graph_object(x):
            return x  # a value (an array, a variable, a State): a pytree, as before
        if id(x) not in ids:
            ids[id(x)] = len(nodes)
            nodes.append(x)
        return _Slot(ids[id(x)])

    def swap(tree):
        return jax.tree_util.tree_map(take, tree, is_leaf=compat.is_graph_node)

    new_args = tuple(a if i in static_argnums else swap(a) for i, a in enumerate(args))
    new_kwargs = {k: v if k in static_argnames else swap(v) for k, v in kwargs.items()}
    if not nodes:
        return None
    graphdef, state = compat.split_nodes(tuple(nodes))
    return Split(graphdef, state, new_args, new_kwargs, tuple(nodes))


def write_back(split: Split, state) -> None:
    """Write the state the traced nodes ended with into the caller's nodes."""
    compat.update_nodes(split.nodes, state)


def pure_function(fn):
    """``pure(graphdef, state, *args, **kwargs) -> (fn's output, final state)``.

    ``fn``'s arguments have their graph nodes as `_Slot`s; ``pure`` puts fresh
    nodes merged from ``(graphdef, state)`` in their place, calls ``fn`` and
    returns the nodes' state after it.  Its name and signature are ``fn``'s
    (after the two leading parameters), so errors and static arguments read as
    for ``fn`` itself.
    """

    def pure(graphdef, state, *args, **kwargs):
        nodes = compat.merge_nodes(graphdef, state)

        def put(x):
            return nodes[x.index] if isinstance(x, _Slot) else x

        def fill(tree):
            return jax.tree_util.tree_map(put, tree, is_leaf=lambda x: isinstance(x, _Slot))

        out = fn(*fill(args), **fill(kwargs))
        return out, compat.node_state(nodes)

    functools.update_wrapper(pure, fn, assigned=("__module__", "__name__", "__qualname__"))
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return pure
    lead = [
        inspect.Parameter(name, inspect.Parameter.POSITIONAL_ONLY)
        for name in ("_flashpass_graphdef", "_flashpass_state")
    ]
    pure.__signature__ = inspect.Signature(lead + params)
    return pure
