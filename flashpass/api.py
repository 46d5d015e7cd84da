"""Public entry points: `optimize`, `explain`, and `Optimized`, the function `optimize` returns.

`Optimized` is the front door: its options, its calls (one ``jax.jit`` of the
rewritten program) and what it reports.  What it leans on lives beside it: the
side table of input signatures in `flashpass.cache`, the static arguments and
the table's key in `flashpass.arguments`, decorated methods in
`flashpass.methods`, calls with Flax NNX objects in `flashpass.nnx_state`.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import difflib
import functools
import os
import threading
import weakref
from collections.abc import Callable, Sequence

import jax
import numpy as np

from flashpass.kernels import Kernel, get_kernel

from . import compat, errors, methods, nnx_state, pipeline, placement
from .arguments import StaticArgs, leaf_aval
from .cache import Entry, SignatureTable, release_freed_memory
from .platforms import KERNEL_PLATFORMS, kernel_platform
from .report import Report
from .select import current_platform, resolve_order

#: Options accepted by `optimize` besides the named parameters.
OPTIONS = {
    "cache_size": "maximum number of input signatures kept (default 32)",
    "strict": "re-raise the pass's internal errors (default: the FLASHPASS_STRICT env var)",
    "zigzag": "load-balance causal rings where they can be (default True)",
}
DEFAULT_CACHE_SIZE = 32
PLATFORMS = KERNEL_PLATFORMS
#: The off switch: ``FLASHPASS_DISABLE=1`` in the environment when `optimize`
#: is called makes the optimized function run the original program under
#: ``jax.jit`` (no matching, no rewrite); its report says it is disabled.
DISABLE_ENV = "FLASHPASS_DISABLE"
#: `optimize`'s parameters, for the unknown-option message.
PARAMETERS = {
    "kernel": "kernel name or ordered list of names (default: the platform's order)",
    "platform": "kernel family: 'cpu', 'gpu' or 'tpu' (default: JAX's default backend)",
    "interpret": "run Pallas kernels in interpret mode (default False)",
    "static_argnums": "positions of non-array arguments, as in jax.jit",
    "static_argnames": "names of non-array arguments, as in jax.jit",
}


def disabled_by_env() -> bool:
    """Whether ``FLASHPASS_DISABLE`` turns the pass off (``1``, ``true``, ``yes``, ``on``)."""
    return os.environ.get(DISABLE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


class _kept:  # noqa: N801 - used as a decorator
    """A method that an instance attribute of its name does not shadow (a data
    descriptor): `Optimized` keeps forwarding copies of ``explain`` and the
    jaxprs in its ``__dict__`` for wrappers that copy it, and reads its own."""

    def __init__(self, fn):
        self.fn = fn
        functools.update_wrapper(self, fn)

    def __get__(self, obj, objtype=None):
        return self if obj is None else functools.partial(self.fn, obj)

    def __set__(self, obj, value):
        raise AttributeError(f"{self.fn.__name__} of an optimized function cannot be set")

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


class Optimized:
    """A function whose attention sites are rewritten to flash-attention kernels.

    Call it like the original.  ``explain(*args, **kwargs)`` returns the
    `Report` for that input signature; ``rewritten_jaxpr`` / ``original_jaxpr``
    return the jaxprs (for golden tests).

    Calling it is calling a ``jax.jit`` of the rewritten program: the pass
    runs when ``jit`` traces, once per input signature, and a cached call is
    ``jit``'s own dispatch.  Whatever the context of the first call (direct,
    under an outer ``jit``, ``eval_shape``, ``grad``, ``vmap``, a ``scan``
    body, ``checkpoint`` or a ``shard_map`` body), the pass sees the same
    program and gives the same report: the function is traced on its own,
    from the arguments' abstract values, and the pass evaluates nothing on
    the enclosing trace.  Reports and rewritten programs are kept in a side
    table of at most ``cache_size`` signatures.
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
        strict: bool | None = None,
        zigzag: bool = True,
    ):
        if not callable(fn):
            raise TypeError(f"flashpass.optimize expects a callable, got {type(fn).__name__}")
        if platform is not None:
            platform = kernel_platform(platform)  # "cuda"/"rocm" are "gpu"
        if not isinstance(cache_size, int) or isinstance(cache_size, bool) or cache_size < 1:
            raise ValueError(f"cache_size must be a positive int, got {cache_size!r}")
        if strict is not None and not isinstance(strict, bool):
            raise TypeError(f"strict must be True, False or None, got {strict!r}")
        if not isinstance(zigzag, bool):
            raise TypeError(f"zigzag must be True or False, got {zigzag!r}")
        self._fn = fn
        self._platform = platform
        if not isinstance(interpret, bool | np.bool_):
            raise TypeError(f"interpret must be True or False, got {interpret!r}")
        self._interpret = bool(interpret)
        self._kernel = kernel
        self._strict = strict
        self._zigzag = zigzag
        # Off: FLASHPASS_DISABLE=1, or kernel=[] (no kernel may run): the
        # original program under jax.jit, with a report saying so.
        self._disabled = ""
        if disabled_by_env():
            self._disabled = f"{DISABLE_ENV}=1"
        elif isinstance(kernel, list | tuple) and not kernel:
            self._disabled = "kernel=[]"
        else:
            # Resolve now so an unknown kernel name fails here, with the known names.
            resolve_order(kernel, platform or "cpu")
        self._statics = StaticArgs(fn, static_argnums, static_argnames)
        self._cache = SignatureTable(cache_size)
        self._cache_size = cache_size
        self._lock = threading.RLock()
        self.traces = 0  # number of trace+match+rewrite runs (for tests and tuning)
        # Decorated methods: id(instance) -> (weakref to it, its Optimized).
        self._instances: dict[int, tuple[weakref.ref, Optimized]] = {}
        # Calls with Flax NNX modules (`_route`); None for the pure function
        # they are routed to, whose arguments are pure state.
        self._nnx: nnx_state.Routes | None = nnx_state.Routes(
            fn, self._statics.nums, self._statics.names
        )
        # Not its __dict__: an optimized function passed in must keep its own state.
        functools.update_wrapper(self, fn, updated=())
        # A wrapper that copies this __dict__ (``functools.wraps``, e.g.
        # ``nnx.jit(flashpass.optimize(step))``) carries the report with it:
        # ``explain`` and the jaxprs as forwarding calls, ``reports`` as a
        # live view (weak references: the wrapper keeps this object alive).
        for name in ("explain", "rewritten_jaxpr", "original_jaxpr"):
            self.__dict__[name] = _Forward(self, name)
        self.__dict__["reports"] = _LiveReports(self)

        this = weakref.ref(self)  # no cycle: the jit below lives in self

        def staged(*args, **kwargs):
            opt = this()
            entry, leaves = opt._entry(args, kwargs)
            if not entry.logged:  # the rewritten program is being staged: now it runs
                entry.logged = True
                pipeline.log_report(entry.report, opt._name())
            error = opt._platform_errors(entry.report)
            if error is not None and leaves:  # lowered for a platform its kernels miss: say so
                runs_on = tuple(p for p in PLATFORMS if error.runs_on(p))
                leaves = [compat.platform_guard(leaves[0], runs_on, error), *leaves[1:]]
            outs = compat.jaxpr_as_fun(entry.rewritten)(*leaves)
            return jax.tree_util.tree_unflatten(entry.out_tree, outs)

        # The name ``jit`` shows in the caller's jaxpr and in profiles.
        name = getattr(fn, "__name__", None)
        staged.__name__ = staged.__qualname__ = name if isinstance(name, str) else "optimized"
        # jit splits each call and dispatches on the static values itself.
        self._jitted = jax.jit(
            staged,
            static_argnums=tuple(sorted(self._statics.nums)),
            static_argnames=tuple(sorted(self._statics.names)),
        )

    # ------------------------------------------------------------------ calling

    def __call__(self, *args, **kwargs):
        target, args, kwargs, split = self._route(args, kwargs)
        if target is not self:  # Flax NNX graph nodes among the arguments
            out, state = target(*args, **kwargs)
            nnx_state.write_back(split, state)
            return out
        foreign = self._platform is not None and self._platform != current_platform()
        if foreign and not _traced(args, kwargs):  # it would run here, now: check first
            self._check_runs_here(args, kwargs)
        try:
            return self._jitted(*args, **kwargs)
        except errors.PlatformError:
            raise
        except Exception as err:
            if foreign:  # lowering a kernel of the other platform here failed
                self._check_runs_here(args, kwargs, cause=err)
            if compat.is_forward_mode_error(err):
                err.add_note(errors.FORWARD_MODE)
                raise
            if not isinstance(err, TypeError | ValueError | OverflowError):
                raise
            # ``jit`` rejected the arguments, or the function raised: say which
            # argument is wrong and how to pass it, when that is the cause.
            problem = self._input_problem(args, kwargs)
            if problem is None or problem is err:
                raise
        raise problem

    @_kept
    def explain(self, *args, **kwargs) -> Report:
        """The rewrite `Report` for these arguments (nothing is executed)."""
        target, args, kwargs, _ = self._route(args, kwargs)
        return target._entry(args, kwargs)[0].report

    def partitioning(self, *args, **kwargs) -> list:
        """How XLA's partitioner places the sites the report shows "placed at
        partitioning", on these (sharded, array) arguments: compiles
        ``jax.jit(self)`` for them (nothing is executed) and returns each
        deferred call's `flashpass.placement.Decision` (empty when no site
        is deferred)."""
        since = placement.decision_count()
        jax.jit(self).lower(*args, **kwargs).compile()
        return placement.decisions(since)

    @_kept
    def rewritten_jaxpr(self, *args, **kwargs):
        """The rewritten ``ClosedJaxpr`` for these arguments."""
        target, args, kwargs, _ = self._route(args, kwargs)
        return target._entry(args, kwargs)[0].rewritten

    @_kept
    def original_jaxpr(self, *args, **kwargs):
        """The ``ClosedJaxpr`` of the original function for these arguments."""
        target, args, kwargs, _ = self._route(args, kwargs)
        return target._entry(args, kwargs)[0].original

    def _check_runs_here(self, args, kwargs, cause=None) -> None:
        """Raise `errors.PlatformError` when a kernel of the program built for
        ``platform=`` cannot run on this host."""
        errors_for = self._platform_errors(self._entry(args, kwargs)[0].report)
        error = None if errors_for is None else errors_for(current_platform())
        if error is not None:
            raise error from cause

    def _platform_errors(self, report: Report):
        """``error(platform)``: the `errors.PlatformError` for running this
        report's program on ``platform`` (None where it runs); None when the
        program runs everywhere or no ``platform=`` was named."""
        if self._platform is None:
            return None
        kernels = [get_kernel(r.kernel) for r in report.rewrites if r.kernel != "ring"]
        if all(set(PLATFORMS) <= set(k.platforms) for k in kernels):
            return None
        return _PlatformErrors(self._name(), self._platform, self._interpret, tuple(kernels))

    def _route(self, args, kwargs):
        """``(optimized, args, kwargs, split)``: ``self`` and the arguments as
        given, or, when they hold Flax NNX modules or optimizers, the optimized
        pure function of their state and its arguments (`flashpass.nnx_state`)."""
        routed = None if self._nnx is None else self._nnx(args, kwargs, self._derive_pure)
        return (self, args, kwargs, None) if routed is None else routed

    def _derive_pure(self, fn, static_argnums, static_argnames) -> Optimized:
        pure = self._derive(fn, static_argnums, static_argnames)
        pure._nnx = None  # its arguments are pure state
        return pure

    def _derive(self, fn, static_argnums, static_argnames) -> Optimized:
        """An `Optimized` of ``fn`` with this one's settings (its off switch
        too, as when this one was made)."""
        derived = Optimized(
            fn,
            kernel=self._kernel,
            platform=self._platform,
            interpret=self._interpret,
            static_argnums=static_argnums,
            static_argnames=static_argnames,
            cache_size=self._cache_size,
            strict=self._strict,
            zigzag=self._zigzag,
        )
        derived._disabled = self._disabled
        return derived

    @property
    def reports(self) -> tuple[Report, ...]:
        """The reports of the cached input signatures, least recently used first
        (e.g. ``reports[-1]`` after a call inside ``vmap`` or ``shard_map``,
        where the signature is the per-example or per-shard one)."""
        with self._lock:
            pure = None if self._nnx is None else self._nnx.optimized
            graph = pure.reports if pure is not None else ()
            return graph + tuple(e.report for e in self._cache.values())

    def cache_info(self) -> dict:
        return {"size": len(self._cache), "max_size": self._cache_size, "traces": self.traces}

    def clear_cache(self) -> None:
        """Drop every cached signature and the compiled programs ``jit`` keeps."""
        with self._lock:
            self._cache.clear()
            self._jitted.clear_cache()
            pure = None if self._nnx is None else self._nnx.optimized
            if pure is not None:
                pure.clear_cache()
        release_freed_memory()

    def __get__(self, obj, objtype=None):
        """Decorated methods: one optimized function (and cache) per instance
        (`flashpass.methods`)."""
        if obj is None:
            return self
        return methods.bound_method(self._instances, self._lock, obj, self._bind)

    def _bind(self, ref) -> Optimized:
        """The `Optimized` of ``self._fn`` with its first argument ``ref()``."""
        method, first = methods.method_of(self._fn, self._statics.params, ref)
        return self._derive(
            method,
            # the instance is bound: positions shift by one
            tuple(i - 1 for i in self._statics.nums if i > 0),
            tuple(n for n in self._statics.names if n != first),
        )

    def _name(self) -> str:
        name = getattr(self._fn, "__qualname__", None)
        return name if isinstance(name, str) else "function"

    def __repr__(self) -> str:
        name = getattr(self._fn, "__qualname__", repr(self._fn))
        return f"<flashpass.optimize of {name}>"

    # ------------------------------------------------------------------ internals

    def _entry(self, args, kwargs) -> tuple[Entry, list]:
        """The side-table entry for these arguments (built on a miss) and the
        dynamic argument leaves; at ``jit`` trace time the leaves are tracers."""
        dyn_args, dyn_kwargs, static_key, rebuild = self._statics.split(args, kwargs)
        leaves, in_tree = jax.tree_util.tree_flatten((dyn_args, dyn_kwargs))
        avals = tuple(leaf_aval(x, in_tree, i) for i, x in enumerate(leaves))
        key = (in_tree, avals, static_key, compat.context_mesh())
        with self._lock:
            entry = self._cache.get(key)
            if entry is not None:
                return entry, leaves
        entry = self._build(avals, in_tree, rebuild)
        with self._lock:
            if not _holds_tracers(entry.rewritten.consts) and self._cache.put(key, entry):
                # Release the evicted signatures' compiled programs: ``jit``
                # keeps one per signature and cannot drop a single one.
                self._jitted.clear_cache()
                release_freed_memory()
        return entry, leaves

    def _input_problem(self, args, kwargs) -> Exception | None:
        """The clear error for bad arguments (non-array leaves, unhashable or
        missing static arguments), or None when the arguments are fine."""
        try:
            dyn_args, dyn_kwargs, _, _ = self._statics.split(args, kwargs)
            leaves, in_tree = jax.tree_util.tree_flatten((dyn_args, dyn_kwargs))
            for i, x in enumerate(leaves):
                leaf_aval(x, in_tree, i)
        except (TypeError, ValueError, OverflowError) as err:
            return err
        return None

    def _build(self, avals, in_tree, rebuild) -> Entry:
        self.traces += 1

        def flat_fn(*leaves):
            d_args, d_kwargs = jax.tree_util.tree_unflatten(in_tree, leaves)
            full_args, full_kwargs = rebuild(d_args, d_kwargs)
            return self._fn(*full_args, **full_kwargs)

        # Tracing errors name the user's function and argument paths, not flat_fn.
        example_args, example_kwargs = rebuild(*jax.tree_util.tree_unflatten(in_tree, avals))
        compat.trace_as(
            flat_fn,
            self._fn,
            example_args,
            example_kwargs,
            self._statics.nums,
            self._statics.names,
            len(avals),
        )
        closed, out_shape = pipeline.trace(flat_fn, avals)
        out_tree = jax.tree_util.tree_structure(out_shape)
        platform = self._platform or current_platform()
        if self._disabled:  # the off switch: the program as traced, under jit
            report = Report(platform=platform, jax_version=jax.__version__, disabled=self._disabled)
            return Entry(closed, closed, out_tree, report)
        with errors.strict_mode(self._strict):
            rewritten, report = pipeline.run_pass(
                closed,
                kernel=self._kernel,
                platform=platform,
                interpret=self._interpret,
                zigzag=self._zigzag,
            )
        pipeline.dump(self._name(), closed, rewritten, report)
        return Entry(closed, rewritten, out_tree, report)


@dataclasses.dataclass(frozen=True)
class _PlatformErrors:
    """``self(host)``: the error for running a program built for ``built_for``
    (with ``kernels``) on ``host``, or None where they all run there (also the
    guard's lowering check, `compat.platform_guard`)."""

    name: str
    built_for: str
    interpret: bool
    kernels: tuple

    def runs_on(self, host: str) -> bool:
        return self(host) is None

    def __call__(self, host: str):
        foreign = {}
        for kernel in self.kernels:
            interpretable = host in kernel.interpret_platforms
            if host not in kernel.platforms and not (self.interpret and interpretable):
                foreign[kernel.name] = interpretable
        if not foreign:
            return None
        return errors.platform_mismatch(self.name, self.built_for, host, foreign)


class _Forward:
    """``optimized.<name>`` as an instance attribute (see `Optimized.__init__`)."""

    def __init__(self, optimized: Optimized, name: str):
        self._ref = weakref.ref(optimized)
        self._name = name
        self.__doc__ = getattr(Optimized, name).__doc__

    def __call__(self, *args, **kwargs):
        return getattr(Optimized, self._name)(self._target(), *args, **kwargs)

    def _target(self) -> Optimized:
        optimized = self._ref()
        if optimized is None:  # pragma: no cover - the wrapper holds it
            raise ReferenceError("the optimized function no longer exists")
        return optimized


class _LiveReports(collections.abc.Sequence):
    """``optimized.reports`` read at each use: for a wrapper that copied the
    optimized function's attributes (``nnx.jit(flashpass.optimize(step))``)."""

    __slots__ = ("_ref",)

    def __init__(self, optimized: Optimized):
        self._ref = weakref.ref(optimized)

    def _now(self) -> tuple:
        optimized = self._ref()
        return () if optimized is None else Optimized.reports.fget(optimized)

    def __getitem__(self, index):
        return self._now()[index]

    def __len__(self) -> int:
        return len(self._now())

    def __repr__(self) -> str:
        return repr(self._now())


def _traced(args, kwargs) -> bool:
    """Whether the call is being traced (e.g. under an outer ``jit`` or
    ``jax.export``, which may lower for another platform than this host)."""
    leaves = jax.tree_util.tree_leaves((args, kwargs))
    return any(compat.is_tracer(x) for x in leaves)


def _holds_tracers(consts) -> bool:
    return any(compat.is_tracer(c) for c in consts)


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
    With ``FLASHPASS_DISABLE=1`` in the environment (read when ``optimize``
    is called) it is ``jax.jit(fn)`` with a report saying the pass is off.

    Args:
      fn: the function to optimize.
      kernel: a kernel name (or `Kernel`), or an ordered sequence of them;
        None tries the platform's default order.  Naming kernels bypasses
        cost heuristics such as the short-sequence cut-off.  An empty list
        turns the pass off for ``fn``, as ``FLASHPASS_DISABLE=1`` does for
        every function: the result runs ``fn`` as written under ``jax.jit``
        and its report says it is disabled.
      platform: "cpu", "gpu" or "tpu", the kernel family to choose kernels
        for ("cuda" and "rocm" are accepted for "gpu"); default: JAX's
        default backend.
      interpret: run Pallas kernels in interpret mode (e.g. TPU kernels on CPU).
      static_argnums, static_argnames: arguments that are not arrays (as in
        ``jax.jit``); they are part of the cache key and must be hashable.
      **options: ``cache_size`` (maximum cached input signatures, default 32);
        ``strict`` (re-raise internal errors of the pass instead of keeping the
        site and reporting them; default: ``FLASHPASS_STRICT`` in the environment);
        ``zigzag`` (load-balance causal rings where they can be, default True;
        False keeps every ring in the user's contiguous order).
    """
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise TypeError(_unknown_options(unknown))

    def wrap(f):
        return Optimized(
            f,
            kernel=kernel,
            platform=platform,
            interpret=interpret,
            static_argnums=static_argnums,
            static_argnames=static_argnames,
            cache_size=options.get("cache_size", DEFAULT_CACHE_SIZE),
            strict=options.get("strict"),
            zigzag=options.get("zigzag", True),
        )

    return wrap if fn is None else wrap(fn)


def _unknown_options(unknown: list[str]) -> str:
    """The message for unknown keyword arguments of `optimize`: a "did you
    mean" for each near miss, then every real option with what it does."""
    real = {**PARAMETERS, **OPTIONS}
    hints = []
    for name in unknown:
        close = difflib.get_close_matches(name, list(real), n=1)
        hints.append(f"{name!r} (did you mean {close[0]!r}?)" if close else repr(name))
    known = "; ".join(f"{k}: {v}" for k, v in real.items())
    return f"unknown flashpass.optimize option(s) {', '.join(hints)}. Its options: {known}"


def explain(fn: Callable, *args, **kwargs) -> Report:
    """The `Report` of what ``optimize(fn)`` does for these arguments.

    ``fn`` may already be an optimized function (its settings are used).
    """
    opt = fn if isinstance(fn, Optimized | methods.BoundMethod) else optimize(fn)
    return opt.explain(*args, **kwargs)
