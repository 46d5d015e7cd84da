"""Flax NNX graph state: the few NNX calls flashpass makes, in one place.

NNX modules and optimizers are *graph nodes*: objects whose variables a step
updates in place.  A ``jax.jit`` only sees them as pytrees (Flax 0.12), so
updates made inside are lost.  flashpass does what ``nnx.jit`` does: split the
nodes to their pure state before tracing, merge it into fresh nodes inside,
and write the state they end with back into the caller's nodes.  Flax is never
imported here unless the caller already has (``sys.modules``): flashpass does
not depend on it.
"""

from __future__ import annotations

import sys


def _nnx():
    return sys.modules.get("flax.nnx")


def nnx_loaded() -> bool:
    """Whether the program uses Flax NNX at all (it is imported)."""
    return _nnx() is not None


def is_graph_node(x) -> bool:
    """Whether ``x`` is an NNX graph node (a module, optimizer, variable...)."""
    nnx = _nnx()
    return nnx is not None and nnx.graph.is_graph_node(x)


def is_graph_object(x) -> bool:
    """Whether ``x`` is an NNX object whose variables a function may update in
    place: a module, optimizer or ``Rngs`` (``nnx.Pytree``; ``nnx.Object``
    before Flax 0.12).  Variables and ``State``s passed as values are not."""
    nnx = _nnx()
    base = getattr(nnx, "Pytree", None) or getattr(nnx, "Object", None)
    return base is not None and isinstance(x, base)


def split_nodes(nodes: tuple):
    """``(graphdef, state)`` of the nodes together (shared references kept)."""
    return _nnx().split(nodes)


def merge_nodes(graphdef, state) -> tuple:
    """Fresh nodes built from ``split_nodes``'s result."""
    return _nnx().merge(graphdef, state)


def node_state(nodes: tuple):
    """The current state of ``nodes`` (the structure ``split_nodes`` gives)."""
    return _nnx().state(nodes)


def update_nodes(nodes: tuple, state) -> None:
    """Write ``state`` into the caller's nodes in place."""
    _nnx().update(nodes, state)
