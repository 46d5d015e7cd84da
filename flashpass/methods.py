"""Decorated methods: one optimized function (and side table) per instance.

``instance.method`` keeps the instance alive, as a bound method does; the
per-instance optimized function holds it only weakly and is dropped when the
instance is (instances are told apart by identity, not ``==``).  An instance
that does not support weak references (``__slots__`` without ``__weakref__``)
gets a fresh one on every attribute access.
"""

from __future__ import annotations

import contextlib
import inspect
import weakref


def bound_method(instances: dict, lock, obj, make) -> BoundMethod:
    """``obj.method``: the optimized function ``instances`` keeps for ``obj``
    (``id(obj) -> (weak reference, optimized)``), made by ``make(ref)`` (``ref()``
    is the instance) on the first access."""
    with lock:
        found = instances.get(id(obj))
        if found is not None and found[0]() is obj:
            return BoundMethod(found[1], obj)
        try:
            ref = weakref.ref(obj)
        except TypeError:
            return BoundMethod(make(lambda: obj), obj)
        bound = make(ref)
        instances[id(obj)] = (ref, bound)
    weakref.finalize(obj, _forget_instance, instances, id(obj), ref)
    return BoundMethod(bound, obj)


def method_of(fn, params, ref):
    """``(method, first)``: ``fn`` with its first argument ``ref()``, named and
    signed as ``fn`` less that parameter (``params``: ``fn``'s signature
    parameters, or None), and that parameter's name (None when it has none)."""

    def method(*args, **kwargs):
        instance = ref()
        if instance is None:  # pragma: no cover - the caller holds the instance
            raise ReferenceError("the instance of this optimized method no longer exists")
        return fn(instance, *args, **kwargs)

    for attr in ("__module__", "__name__", "__qualname__", "__doc__"):
        with contextlib.suppress(AttributeError):
            setattr(method, attr, getattr(fn, attr))
    first = None
    if params is not None:
        params = list(params.values())
        if params and params[0].kind in (
            params[0].POSITIONAL_ONLY,
            params[0].POSITIONAL_OR_KEYWORD,
        ):
            first = params[0].name
            method.__signature__ = inspect.Signature(params[1:])
    return method, first


class BoundMethod:
    """``instance.method`` of an optimized method.

    Holds the instance, as a Python bound method does, and calls the
    instance's `Optimized` (which holds it only weakly); its attributes
    (``explain``, ``cache_info``...) are that `Optimized`'s.
    """

    __slots__ = ("__self__", "_optimized", "__weakref__")

    def __init__(self, optimized, instance):
        self._optimized = optimized
        self.__self__ = instance

    def __call__(self, *args, **kwargs):
        return self._optimized(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._optimized, name)

    def __repr__(self) -> str:
        return f"<bound {self._optimized!r} of {self.__self__!r}>"


def _forget_instance(instances: dict, key: int, ref) -> None:
    """Drop a dead instance's `Optimized` (unless the id was reused meanwhile)."""
    found = instances.get(key)
    if found is not None and found[0] is ref:
        instances.pop(key, None)
