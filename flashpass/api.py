"""Public entry points: `optimize` and `explain`."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import inspect
import logging
import numbers
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from flashpass.kernels import CheckContext, Kernel

from . import compat
from .graph import build_scopes
from .match import find_sites
from .report import Fallback, Report, Rewrite
from .rewrite import Plan, PlannedSite, rewrite
from .select import choose, current_platform, resolve_order

logger = logging.getLogger("flashpass")

#: Options accepted by `optimize` besides the named parameters.
OPTIONS = {
    "cache_size": "maximum number of input signatures kept (default 32)",
}
DEFAULT_CACHE_SIZE = 32
PLATFORMS = ("cpu", "gpu", "tpu")


@dataclasses.dataclass
class _Entry:
    """Everything cached for one input signature."""

    original: Any  # ClosedJaxpr as traced
    rewritten: Any  # ClosedJaxpr after the pass
    out_tree: Any
    report: Report
    call: Callable


class Optimized:
    """A function whose attention sites are rewritten to flash-attention kernels.

    Call it like the original.  ``explain(*args, **kwargs)`` returns the
    `Report` for that input signature; ``rewritten_jaxpr`` / ``original_jaxpr``
    return the jaxprs (for golden tests).  The first call per input signature
    traces, matches and rewrites; later calls reuse the cached result.
    """

    def __init__(
        self,
        fn: Callable,
        *,
        kernel=None,
        platform: str | None = None,
        interpret: bool = False,
        static_argnums=(),
        static_argnames=(),
        cache_size: int = DEFAULT_CACHE_SIZE,
    ):
        if not callable(fn):
            raise TypeError(f"flashpass.optimize expects a callable, got {type(fn).__name__}")
        if platform is not None and platform not in PLATFORMS:
            raise ValueError(f"platform must be one of {PLATFORMS} or None, got {platform!r}")
        if not isinstance(cache_size, int) or isinstance(cache_size, bool) or cache_size < 1:
            raise ValueError(f"cache_size must be a positive int, got {cache_size!r}")
        self._fn = fn
        self._platform = platform
        if not isinstance(interpret, bool | np.bool_):
            raise TypeError(f"interpret must be True or False, got {interpret!r}")
        self._interpret = bool(interpret)
        self._kernel = kernel
        # Resolve now so an unknown kernel name fails here, with the known names.
        resolve_order(kernel, platform or "cpu")
        self._static_argnums, self._static_argnames, self._params = _static_args(
            fn, static_argnums, static_argnames
        )
        # Names of the parameters a static position may also be passed by keyword.
        self._keyword_names = tuple(
            p.name if p.kind == p.POSITIONAL_OR_KEYWORD else None
            for p in (self._params or {}).values()
        )
        self._cache: collections.OrderedDict = collections.OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.RLock()
        self.traces = 0  # number of trace+match+rewrite runs (for tests and tuning)
        # Decorated methods: id(instance) -> (weakref to it, its Optimized).
        self._instances: dict[int, tuple[weakref.ref, Optimized]] = {}
        functools.update_wrapper(self, fn)

    # ------------------------------------------------------------------ calling

    def __call__(self, *args, **kwargs):
        entry, leaves = self._lookup(args, kwargs)
        return jax.tree_util.tree_unflatten(entry.out_tree, entry.call(*leaves))

    def explain(self, *args, **kwargs) -> Report:
        """The rewrite `Report` for these arguments (nothing is executed)."""
        return self._lookup(args, kwargs)[0].report

    def rewritten_jaxpr(self, *args, **kwargs):
        """The rewritten ``ClosedJaxpr`` for these arguments."""
        return self._lookup(args, kwargs)[0].rewritten

    def original_jaxpr(self, *args, **kwargs):
        """The ``ClosedJaxpr`` of the original function for these arguments."""
        return self._lookup(args, kwargs)[0].original

    def cache_info(self) -> dict:
        return {"size": len(self._cache), "max_size": self._cache_size, "traces": self.traces}

    def clear_cache(self) -> None:
        with self._lock:
            self._cache.clear()

    def __get__(self, obj, objtype=None):
        """Decorated methods: one optimized function (and cache) per instance.

        ``instance.method`` keeps the instance alive, as a bound method does;
        the per-instance cache holds it only weakly and is dropped when the
        instance is (instances are told apart by identity, not ``==``).  An
        instance that does not support weak references (``__slots__`` without
        ``__weakref__``) gets a fresh cache on every attribute access.
        """
        if obj is None:
            return self
        with self._lock:
            found = self._instances.get(id(obj))
            if found is not None and found[0]() is obj:
                return _BoundMethod(found[1], obj)
            try:
                ref = weakref.ref(obj)
            except TypeError:
                return _BoundMethod(self._bind(lambda: obj), obj)
            bound = self._bind(ref)
            self._instances[id(obj)] = (ref, bound)
        weakref.finalize(obj, _forget_instance, self._instances, id(obj), ref)
        return _BoundMethod(bound, obj)

    def _bind(self, ref) -> Optimized:
        """The `Optimized` of ``self._fn`` with its first argument ``ref()``."""
        fn = self._fn

        def method(*args, **kwargs):
            instance = ref()
            if instance is None:  # pragma: no cover - the caller holds the instance
                raise ReferenceError("the instance of this optimized method no longer exists")
            return fn(instance, *args, **kwargs)

        for attr in ("__module__", "__name__", "__qualname__", "__doc__"):
            with contextlib.suppress(AttributeError):
                setattr(method, attr, getattr(fn, attr))
        first = None
        if self._params is not None:
            params = list(self._params.values())
            if params and params[0].kind in (
                params[0].POSITIONAL_ONLY,
                params[0].POSITIONAL_OR_KEYWORD,
            ):
                first = params[0].name
                method.__signature__ = inspect.Signature(params[1:])
        return Optimized(
            method,
            kernel=self._kernel,
            platform=self._platform,
            interpret=self._interpret,
            # the instance is bound: positions shift by one
            static_argnums=tuple(i - 1 for i in self._static_argnums if i > 0),
            static_argnames=tuple(n for n in self._static_argnames if n != first),
            cache_size=self._cache_size,
        )

    def __repr__(self) -> str:
        name = getattr(self._fn, "__qualname__", repr(self._fn))
        return f"<flashpass.optimize of {name}>"

    # ------------------------------------------------------------------ internals

    def _lookup(self, args, kwargs):
        dyn_args, dyn_kwargs, static_key, rebuild = self._split(args, kwargs)
        leaves, in_tree = jax.tree_util.tree_flatten((dyn_args, dyn_kwargs))
        key = (in_tree, tuple(map(_leaf_key, leaves)), static_key, compat.context_mesh())
        with self._lock:
            entry = self._cache.get(key)
            if entry is not None:
                self._cache.move_to_end(key)
                return entry, leaves
        structs = [_struct(x, in_tree, i) for i, x in enumerate(leaves)]
        entry = self._build(structs, in_tree, rebuild)
        with self._lock:
            if not _holds_tracers(entry.rewritten.consts):
                self._cache[key] = entry
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
        return entry, leaves

    def _split(self, args, kwargs):
        """``(dynamic args, dynamic kwargs, static key, rebuild)`` of one call.

        A static parameter may be passed by position or by keyword (as with
        ``jax.jit``); the key names it the same way for both, so the two forms
        share a cache entry.
        """
        static_pos, static_names = self._static_argnums, self._static_argnames
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
                    raise TypeError(
                        f"{getattr(self._fn, '__name__', 'fn')}() got multiple values for "
                        f"argument {name!r}"
                    )
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
        param = (self._params or {}).get(name)
        return param is not None and param.default is not param.empty

    def _build(self, structs, in_tree, rebuild) -> _Entry:
        self.traces += 1

        def flat_fn(*leaves):
            d_args, d_kwargs = jax.tree_util.tree_unflatten(in_tree, leaves)
            full_args, full_kwargs = rebuild(d_args, d_kwargs)
            return self._fn(*full_args, **full_kwargs)

        closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*structs)
        out_tree = jax.tree_util.tree_structure(out_shape)
        platform = self._platform or current_platform()
        rewritten, report = run_pass(
            closed, kernel=self._kernel, platform=platform, interpret=self._interpret
        )
        _log(report, getattr(self._fn, "__qualname__", "function"))
        call = jax.jit(compat.jaxpr_as_fun(rewritten))
        return _Entry(closed, rewritten, out_tree, report, call)


class _BoundMethod:
    """``instance.method`` of an optimized method.

    Holds the instance, as a Python bound method does, and calls the
    instance's `Optimized` (which holds it only weakly); its attributes
    (``explain``, ``cache_info``...) are that `Optimized`'s.
    """

    __slots__ = ("__self__", "_optimized", "__weakref__")

    def __init__(self, optimized: Optimized, instance):
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


def run_pass(closed, *, kernel=None, platform: str = "cpu", interpret: bool = False):
    """Find, choose and rewrite every site of ``closed``: ``(rewritten, Report)``."""
    kernels, explicit = resolve_order(kernel, platform)
    ctx = CheckContext(platform=platform, interpret=interpret, explicit=explicit)
    scopes = build_scopes(closed)
    where_is = _scope_names(scopes)
    report = Report(platform=platform, jax_version=jax.__version__)
    planned: list[PlannedSite] = []
    for scope in scopes:
        sites, misses = find_sites(scope)
        for miss in misses:
            report.fallbacks.append(Fallback(miss.location, miss.reason, where_is[scope.prefix]))
        for site in sites:
            chosen, rejections = choose(site.spec, kernels, ctx)
            if chosen is None:
                reason = _rejection_summary(rejections)
                report.fallbacks.append(
                    Fallback(
                        site.location, reason, where_is[scope.prefix], site.pattern, rejections
                    )
                )
                continue
            planned.append(PlannedSite(site, chosen, interpret, rejections))
    if not planned:
        return closed, report
    plan = Plan(planned, scopes)
    try:
        rewritten = rewrite(closed, plan)
    except Exception as err:  # a rewriter bug must never break the user's program
        message = (str(err).strip().splitlines() or [""])[0][:300]
        for p in planned:
            report.fallbacks.append(
                Fallback(
                    p.site.location,
                    f"rewriting the enclosing body failed: {type(err).__name__}: {message}",
                    where_is[p.site.scope_prefix],
                    p.site.pattern,
                )
            )
        return closed, report
    for p in planned:
        kept = plan.kept.get(p.site.root.path)  # cannot run per shard (sharding.py)
        if kept is not None:
            report.fallbacks.append(
                Fallback(p.site.location, kept, where_is[p.site.scope_prefix], p.site.pattern)
            )
            continue
        failure = _failure_for(plan, p.site.scope_prefix)
        if failure is not None:
            report.fallbacks.append(
                Fallback(
                    p.site.location,
                    f"rewriting the enclosing body failed: {failure}",
                    where_is[p.site.scope_prefix],
                    p.site.pattern,
                )
            )
            continue
        report.rewrites.append(_rewrite_entry(p, where_is[p.site.scope_prefix]))
    return rewritten, report


def _rejection_summary(rejections: dict) -> str:
    """The fallback reason: the single kernel's first reason, or one per kernel."""
    if len(rejections) == 1:
        return next(iter(rejections.values()))[0]
    return "no kernel accepts this site: " + "; ".join(
        f"{name}: {reasons[0]}" for name, reasons in rejections.items()
    )


def _failure_for(plan: Plan, prefix: tuple) -> str | None:
    for failed, error in plan.failed.items():
        if prefix[: len(failed)] == failed:
            return error
    return None


def _rewrite_entry(p: PlannedSite, scope_name: str) -> Rewrite:
    from flashpass.kernels import Bias, Causal, Mask

    spec = p.site.spec
    kinds = []
    if spec.ops_of(Causal):
        kinds.append("causal")
    if spec.ops_of(Mask):
        kinds.append("boolean")
    return Rewrite(
        pattern=p.site.pattern,
        kernel=p.kernel.name,
        location=p.site.location,
        q_shape=p.site.q.shape,
        k_shape=p.site.k.shape,
        v_shape=p.site.v.shape,
        dtype=np.dtype(spec.q_dtype).name,
        causal=bool(spec.ops_of(Causal)),
        mask="+".join(kinds) or "none",
        bias=bool(spec.ops_of(Bias)),
        scale=spec.scale,
        scope=scope_name,
        spec=spec.describe(),
        rejected=dict(p.rejected),
    )


def _scope_names(scopes) -> dict:
    names = {(): "top level"}
    for scope in scopes:
        for child in scope.children:
            loc = child.node.location
            names[child.prefix] = f"{child.node.prim} body" + (f" at {loc}" if loc else "")
    return names


def _log(report: Report, name: str) -> None:
    if not logger.isEnabledFor(logging.INFO):
        return
    for r in report.rewrites:
        logger.info(
            "%s: rewrote attention at %s with %s (%s)", name, r.location, r.kernel, r.pattern
        )
    for f in report.fallbacks:
        logger.info("%s: kept attention at %s as written: %s", name, f.location, f.reason)


#: Types seen to be concrete ``jax.Array``s: `_leaf_key` skips the (slow,
#: abstract-base-class) ``isinstance`` checks for them.
_CONCRETE_ARRAY_TYPES: set = set()


def _leaf_key(x):
    """Cheap cache-key part of one argument leaf (the hot path of a cached call)."""
    if type(x) not in _CONCRETE_ARRAY_TYPES:
        if isinstance(x, jax.core.Tracer):
            aval = x.aval
            return (aval.shape, aval.dtype, aval.weak_type, compat.traced_sharding(aval))
        if isinstance(x, np.ndarray | np.generic):
            return (np.shape(x), np.dtype(x.dtype), False)
        if not isinstance(x, jax.Array):
            return (type(x), getattr(x, "shape", None), getattr(x, "dtype", None))
        if hasattr(x, "weak_type"):
            _CONCRETE_ARRAY_TYPES.add(type(x))
    sharding = x.sharding
    if not isinstance(sharding, jax.sharding.NamedSharding):
        sharding = None
    return (x.shape, x.dtype, getattr(x, "weak_type", False), sharding)


def _struct(x, in_tree, index) -> jax.ShapeDtypeStruct:
    if isinstance(x, jax.ShapeDtypeStruct):
        return x
    if isinstance(x, jax.Array | np.ndarray | np.generic) or isinstance(x, jax.core.Tracer):
        if isinstance(x, np.ndarray | np.generic) and not _numeric(x.dtype):
            raise TypeError(
                f"argument leaf {_leaf_path(in_tree, index)} has dtype {x.dtype}, not a "
                "number type; pass it through static_argnums/static_argnames, or close over it"
            )
        aval = compat.get_aval(x)
        # Keep the sharding: with Explicit mesh axes it is part of the program's types.
        return jax.ShapeDtypeStruct(
            aval.shape, aval.dtype, weak_type=aval.weak_type, sharding=compat.traced_sharding(aval)
        )
    if isinstance(x, bool | numbers.Number):
        if type(x) is int and not -(2**31) <= x < 2**31 and not jax.config.jax_enable_x64:
            raise TypeError(
                f"argument leaf {_leaf_path(in_tree, index)} = {x} does not fit in int32; pass an "
                "array with an explicit dtype (int64 needs jax_enable_x64), or use static_argnums"
                "/static_argnames"
            )
        aval = compat.get_aval(jax.numpy.asarray(x))
        return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=True)
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


def _holds_tracers(consts) -> bool:
    return any(isinstance(c, jax.core.Tracer) for c in consts)


def _static_args(fn, argnums, argnames):
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
    params = None if signature_params is None else list(signature_params.values())
    if params is not None:
        positional = [
            p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        has_varargs = any(p.kind == p.VAR_POSITIONAL for p in params)
        has_varkw = any(p.kind == p.VAR_KEYWORD for p in params)
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
                    f"static_argnums={i} but {getattr(fn, '__name__', 'fn')} takes "
                    f"{len(positional)} positional arguments"
                )
        known = {p.name for p in params}
        for n in argnames:
            if n not in known and not has_varkw:
                raise ValueError(
                    f"static_argnames={n!r} is not a parameter of "
                    f"{getattr(fn, '__name__', 'fn')}; parameters: {sorted(known)}"
                )
            if n in positional:
                nums.add(positional.index(n))
    return frozenset(nums), frozenset(names), signature_params


def optimize(
    fn: Callable | None = None,
    *,
    kernel: str | Kernel | Sequence[str | Kernel] | None = None,
    platform: str | None = None,
    interpret: bool = False,
    static_argnums: int | Sequence[int] = (),
    static_argnames: str | Sequence[str] = (),
    **options,
):
    """Rewrite every attention site of ``fn`` to a flash-attention kernel.

    Usable as ``@optimize``, ``@optimize(kernel="blockwise")`` or
    ``optimize(model.apply, ...)``.  The result has ``fn``'s signature and
    outputs and composes with ``jax.jit``, ``jax.grad`` and ``jax.vmap``.

    Args:
      fn: the function to optimize.
      kernel: a kernel name (or `Kernel`), or an ordered sequence of them;
        None tries the platform's default order.  Naming kernels bypasses
        cost heuristics such as the short-sequence cut-off.
      platform: "cpu", "gpu" or "tpu" to choose kernels for; default: JAX's
        default backend.
      interpret: run Pallas kernels in interpret mode (e.g. TPU kernels on CPU).
      static_argnums, static_argnames: arguments that are not arrays (as in
        ``jax.jit``); they are part of the cache key and must be hashable.
      **options: ``cache_size`` (maximum cached input signatures, default 32).
    """
    unknown = set(options) - set(OPTIONS)
    if unknown:
        known = ", ".join(f"{k} ({v})" for k, v in OPTIONS.items())
        raise TypeError(f"unknown flashpass.optimize option(s) {sorted(unknown)}; known: {known}")

    def wrap(f):
        return Optimized(
            f,
            kernel=kernel,
            platform=platform,
            interpret=interpret,
            static_argnums=static_argnums,
            static_argnames=static_argnames,
            cache_size=options.get("cache_size", DEFAULT_CACHE_SIZE),
        )

    return wrap if fn is None else wrap(fn)


def explain(fn: Callable, *args, **kwargs) -> Report:
    """The `Report` of what ``optimize(fn)`` does for these arguments.

    ``fn`` may already be an optimized function (its settings are used).
    """
    opt = fn if isinstance(fn, Optimized | _BoundMethod) else optimize(fn)
    return opt.explain(*args, **kwargs)
