"""An optimized function's arguments: its static ones, and the side table's key.

The key of one call is ``(argument tree, abstract values of its leaves, static
key, mesh)``: `leaf_aval` gives each array leaf the type ``jit`` gives it (or
says which leaf is not an array and how to pass it), and `StaticArgs` the
static values.

``jax.jit`` does the work for the compiled call: `flashpass.api.Optimized`
hands it these static positions and names, ``jit`` splits each call and
dispatches on the static values, and the traced function receives them as
Python values.  What stays here is what ``jit`` does not give:

* the side table's key.  The table is read and filled outside ``jit`` too
  (``explain`` and the jaxprs run nothing, and the platform check runs before
  the call), so one call's static values must be found without ``jit``.  And
  ``jit`` keys a static parameter passed by position apart from the same one
  passed by keyword, while the table gives both one entry (one pass run,
  ``traces``), so the key names each by its parameter;
* the spec checked against the function's signature when ``optimize`` is
  called (``jit`` checks against the signature of the function it wraps, which
  takes ``*args, **kwargs``), and a call's mistakes (a static argument
  missing, passed twice, unhashable) said in terms of the user's function,
  raised from flashpass rather than from inside JAX.
"""

from __future__ import annotations

import inspect
import numbers

import jax
import numpy as np

from . import compat


class StaticArgs:
    """The static positions and names of ``fn`` (a static parameter that has
    both gets both), checked against its signature when there is one."""

    def __init__(self, fn, argnums, argnames):
        self.fn_name = getattr(fn, "__name__", "fn")
        self.nums, self.names, self.params = _resolve(fn, argnums, argnames)
        # Names of the parameters a static position may also be passed by keyword.
        self._keyword_names = tuple(
            p.name if p.kind == p.POSITIONAL_OR_KEYWORD else None
            for p in (self.params or {}).values()
        )

    def split(self, args, kwargs):
        """``(dynamic args, dynamic kwargs, static key, rebuild)`` of one call.

        A static parameter may be passed by position or by keyword (as with
        ``jax.jit``); the key names it the same way for both, so the two forms
        share a side-table entry.  ``rebuild(dynamic args, dynamic kwargs)``
        puts the static values back: ``(args, kwargs)`` for the function.
        """
        static_pos, static_names = self.nums, self.names
        for i in static_pos:
            if i >= len(args):
                name = self._positional_name(i)
                if name is not None and (name in kwargs or self._has_default(name)):
                    continue  # passed by keyword, or the function's default applies
                by_keyword = f" and {name!r} was not passed by keyword" if name else ""
                raise ValueError(
                    f"static_argnums={i} but only {len(args)} positional arguments were "
                    f"passed{by_keyword}"
                )
        dyn_args = tuple(a for i, a in enumerate(args) if i not in static_pos)
        dyn_kwargs = {k: v for k, v in kwargs.items() if k not in static_names}
        named = {k: v for k, v in kwargs.items() if k in static_names}
        unnamed = []  # static positions without a name (inside *args)
        for i in sorted(static_pos):
            if i < len(args):
                name = self._positional_name(i)
                if name is None:
                    unnamed.append((i, args[i]))
                elif name in named:
                    raise TypeError(f"{self.fn_name}() got multiple values for argument {name!r}")
                else:
                    named[name] = args[i]
        statics = (tuple(unnamed), tuple(sorted(named.items())))
        try:
            hash(statics)
        except TypeError as err:
            raise TypeError(
                f"static arguments must be hashable ({err}); pass arrays as non-static arguments"
            ) from None

        def rebuild(d_args, d_kwargs):
            it = iter(d_args)
            full = [args[i] if i in static_pos else next(it) for i in range(len(args))]
            return full, {**d_kwargs, **{k: kwargs[k] for k in kwargs if k in static_names}}

        return dyn_args, dyn_kwargs, statics, rebuild

    def _positional_name(self, i: int) -> str | None:
        """The name of positional parameter ``i`` (None: inside ``*args``, or unknown)."""
        return self._keyword_names[i] if i < len(self._keyword_names) else None

    def _has_default(self, name: str) -> bool:
        param = (self.params or {}).get(name)
        return param is not None and param.default is not param.empty


def _resolve(fn, argnums, argnames):
    """``(static positions, static names, fn's signature parameters or None)``;
    a static parameter that has both gets both."""
    if isinstance(argnums, int):
        argnums = (argnums,)
    if isinstance(argnames, str):
        argnames = (argnames,)
    try:
        argnums = tuple(argnums)
        argnames = tuple(argnames)
    except TypeError:
        raise TypeError("static_argnums must be ints and static_argnames strings") from None
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in argnums):
        raise TypeError(f"static_argnums must be ints, got {argnums!r}")
    if not all(isinstance(n, str) for n in argnames):
        raise TypeError(f"static_argnames must be strings, got {argnames!r}")
    nums, names = set(argnums), set(argnames)
    try:
        signature_params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        signature_params = None
    if signature_params is not None:
        _complete(fn, list(signature_params.values()), argnames, nums, names)
    return frozenset(nums), frozenset(names), signature_params


def _complete(fn, params, argnames, nums: set, names: set) -> None:
    """Check the spec against ``fn``'s parameters and complete ``nums`` and
    ``names`` in place (a static position's name, a static name's position;
    negative positions counted from the end)."""
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    has_varargs = any(p.kind == p.VAR_POSITIONAL for p in params)
    has_varkw = any(p.kind == p.VAR_KEYWORD for p in params)
    fn_name = getattr(fn, "__name__", "fn")
    for i in list(nums):
        if i < 0:
            if has_varargs:
                raise ValueError("negative static_argnums need a fixed number of arguments")
            nums.discard(i)
            i += len(positional)
            if i < 0:
                raise ValueError(f"static_argnums {i} is out of range")
            nums.add(i)
        if i < len(positional):
            names.add(positional[i])
        elif not has_varargs:
            raise ValueError(
                f"static_argnums={i} but {fn_name} takes {len(positional)} positional arguments"
            )
    known = {p.name for p in params}
    for n in argnames:
        if n not in known and not has_varkw:
            raise ValueError(
                f"static_argnames={n!r} is not a parameter of {fn_name}; "
                f"parameters: {sorted(known)}"
            )
        if n in positional:
            nums.add(positional.index(n))


def leaf_aval(x, in_tree, index):
    """The abstract value ``jit`` gives argument leaf ``x`` (``jax.typeof``: for
    a tracer, its type; for an array, its shape, dtype, weak type and sharding),
    or a clear error for a leaf that is not an array or number."""
    if isinstance(x, jax.ShapeDtypeStruct):
        return compat.struct_aval(x)
    if isinstance(x, jax.Array | np.ndarray | np.generic) or compat.is_tracer(x):
        if isinstance(x, np.ndarray | np.generic) and not _numeric(x.dtype):
            raise TypeError(
                f"argument leaf {_leaf_path(in_tree, index)} has dtype {x.dtype}, not a "
                "number type; pass it through static_argnums/static_argnames, or close over it"
            )
        return jax.typeof(x)
    if isinstance(x, bool | numbers.Number):
        if type(x) is int and not -(2**31) <= x < 2**31 and not jax.config.jax_enable_x64:
            raise TypeError(
                f"argument leaf {_leaf_path(in_tree, index)} = {x} does not fit in int32; pass an "
                "array with an explicit dtype (int64 needs jax_enable_x64), or use static_argnums"
                "/static_argnames"
            )
        return jax.typeof(x)
    path = _leaf_path(in_tree, index)
    raise TypeError(
        f"argument leaf {path} is a {type(x).__name__}, not an array or number; "
        "pass it through static_argnums/static_argnames, or close over it"
    )


def _numeric(dtype) -> bool:
    return dtype == np.bool_ or jax.numpy.issubdtype(dtype, jax.numpy.number)


def _leaf_path(in_tree, index) -> str:
    dummy = jax.tree_util.tree_unflatten(in_tree, list(range(in_tree.num_leaves)))
    for path, leaf in jax.tree_util.tree_flatten_with_path(dummy)[0]:
        if leaf == index:
            return jax.tree_util.keystr(path)
    return f"#{index}"
