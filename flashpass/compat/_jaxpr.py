"""Jaxpr data structures, re-binding and evaluation, source info (see compat/__init__.py)."""

from __future__ import annotations

import contextlib
import inspect

import jax

from . import _host

try:
    from jax._src import core as _core
    from jax._src import source_info_util as _siu
    from jax._src.interpreters import partial_eval as _pe
except ImportError as err:  # pragma: no cover - a JAX that moved its internals
    raise ImportError(
        f"flashpass supports JAX 0.9 to 0.12; JAX {jax.__version__} has no {err.name}"
    ) from err

JAX_VERSION: tuple[int, ...] = tuple(int(p) for p in jax.__version__.split(".")[:3] if p.isdigit())


# --------------------------------------------------------------------------- jaxpr types

#: JAX 0.11 merged ``ClosedJaxpr`` into ``Jaxpr`` (one class that may carry its
#: constants; 0.11 kept ``ClosedJaxpr`` as an alias, 0.12 removed the name).
#: Before, a higher-order primitive's body was either a ``ClosedJaxpr`` or an
#: *open* ``Jaxpr`` (no constants).  Other modules never test these classes:
#: they use `is_body`, `bodies_in_params`, `as_closed`, `closed_parts`,
#: `replace_bodies` and `rebuild_body` below.
UNIFIED_JAXPR: bool = getattr(_core, "ClosedJaxpr", None) in (None, _core.Jaxpr)
_ClosedJaxpr = _core.Jaxpr if UNIFIED_JAXPR else _core.ClosedJaxpr
_BODY_TYPES: tuple = (_core.Jaxpr,) if UNIFIED_JAXPR else (_core.ClosedJaxpr, _core.Jaxpr)
JaxprEqn = _core.JaxprEqn
Var = _core.Var
Literal = _core.Literal
DropVar = _core.DropVar
ShapedArray = _core.ShapedArray
Primitive = _core.Primitive


def is_literal(atom) -> bool:
    return isinstance(atom, _core.Literal)


def is_tracer(x) -> bool:
    """Whether ``x`` is a tracer of some JAX trace (``jax.core.Tracer``)."""
    return isinstance(x, jax.core.Tracer)


def literal_value(atom):
    return atom.val


def get_aval(x):
    """Abstract value of a concrete or traced array."""
    return jax.typeof(x)


def is_drop_var(var) -> bool:
    """Whether an equation's output ``var`` is dropped (``_``)."""
    return isinstance(var, _core.DropVar)


def subjaxprs_of_params(params) -> list:
    """All bodies (jaxprs) held in an equation's params, as `is_body` values."""
    return [body for _, _, body in bodies_in_params(params)]


def is_body(value) -> bool:
    """Whether a param value is a jaxpr: the body of a higher-order primitive."""
    return isinstance(value, _BODY_TYPES)


def bodies_in_params(params) -> list[tuple[str, int | None, object]]:
    """``(param name, index, body)`` for every jaxpr in an equation's params:
    ``index`` is the position inside a tuple param (``cond``'s ``branches``),
    else None."""
    found = []
    for name, value in params.items():
        if isinstance(value, tuple):
            found.extend((name, j, item) for j, item in enumerate(value) if is_body(item))
        elif is_body(value):
            found.append((name, None, value))
    return found


def replace_bodies(params, new_bodies: dict) -> dict:
    """A copy of ``params`` with the bodies at ``{(name, index): body}`` (keys
    as `bodies_in_params` gives them) replaced."""
    out = dict(params)
    for (name, index), body in new_bodies.items():
        if index is None:
            out[name] = body
        else:
            items = list(out[name])
            items[index] = body
            out[name] = tuple(items)
    return out


def closed_jaxpr(jaxpr, consts=()):
    """``jaxpr`` (an open jaxpr) closed over ``consts``."""
    return _ClosedJaxpr(jaxpr, list(consts))


def as_closed(body):
    """A body as a closed jaxpr (``.jaxpr``, ``.consts``): open bodies are
    wrapped with no constants; closed ones (and every body since JAX 0.11)
    are returned as they are."""
    if UNIFIED_JAXPR or isinstance(body, _core.ClosedJaxpr):
        return body
    return closed_jaxpr(body, ())


def closed_parts(closed) -> tuple:
    """``(jaxpr, consts)`` of a closed jaxpr (or any body): the jaxpr whose
    ``constvars``/``invars``/``eqns``/``outvars`` to walk, and the constants'
    values (one per ``constvar``)."""
    closed = as_closed(closed)
    if UNIFIED_JAXPR:
        return closed, list(closed.consts)
    return closed.jaxpr, list(closed.consts)


def scan_counts(params) -> tuple[int, int]:
    """``(num_consts, num_carry)`` of a ``scan`` equation: its operands are that
    many constants, then the carry, then the scanned arrays.  JAX 0.11 replaced
    the ``num_consts``/``num_carry`` params with ``ft_in`` (a flat tree of the
    three groups; loop-invariant carries count as constants)."""
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    consts, carry, _ = params["ft_in"].unpack()
    return len(consts.vals), len(carry.vals)


def is_view_identity(eqn) -> bool:
    """An equation the pass's view reads as its operand: a no-op rounding, a
    change of type only (`pvary` in a ``shard_map`` body with ``check_vma``,
    which a backward template traced outside the body does not have), or a
    window over the whole operand (`is_whole_window`)."""
    from ._sharding import VALUE_IDENTITY_PRIMITIVES

    if eqn.primitive.name in VALUE_IDENTITY_PRIMITIVES:
        return len(eqn.invars) == 1 and len(eqn.outvars) == 1
    return is_noop_rounding(eqn) or is_whole_window(eqn)


def is_whole_window(eqn) -> bool:
    """A ``dynamic_slice`` whose window is the operand's whole shape, or a
    ``slice`` from 0 to each extent with unit strides: an identity.  A dynamic
    start is clamped to ``[0, extent - size]``, which is ``[0, 0]`` here, so
    whatever its value the output is the operand (haliax materialises a
    mask through ``mask[QPos, dslice(0, QPos.size), ...]``, a ``dynamic_slice``
    at traced-or-literal zeros over the full extents)."""
    prim = eqn.primitive.name
    if prim not in ("dynamic_slice", "slice") or len(eqn.outvars) != 1:
        return False
    shape = tuple(eqn.invars[0].aval.shape)
    if tuple(eqn.outvars[0].aval.shape) != shape:
        return False
    if prim == "dynamic_slice":
        return tuple(eqn.params.get("slice_sizes", ())) == shape
    strides = eqn.params.get("strides")
    return (
        tuple(eqn.params.get("start_indices", ())) == (0,) * len(shape)
        and tuple(eqn.params.get("limit_indices", ())) == shape
        and (strides is None or all(s == 1 for s in strides))
    )


def bind_view_identity(eqn, value) -> list:
    """``eqn`` (`is_view_identity`) bound on ``value``: a `pvary` whose value
    already varies over its axes (a rewritten value can vary where the
    original did not) passes it on as it is."""
    from ._sharding import varying_axes

    if is_whole_window(eqn):  # its start indices select nothing: the operand itself
        return [value]
    if eqn.primitive.name == "pvary":
        axes = eqn.params.get("axes", ())
        axes = set(axes) if isinstance(axes, tuple | list) else {axes}
        if axes <= varying_axes(value):
            return [value]
    return bind_equation(eqn, [value])


def is_noop_rounding(eqn) -> bool:
    """A ``reduce_precision`` to its operand's own precision: an identity.  Remat
    policies that save values (``everything_saveable``, ``save_anything_except_these_names``)
    put one on each saved value as a CSE barrier."""
    if eqn.primitive.name != "reduce_precision":
        return False
    try:
        info = jax.numpy.finfo(eqn.invars[0].aval.dtype)
    except (TypeError, ValueError):
        return False
    return (
        eqn.params.get("exponent_bits") == info.nexp
        and eqn.params.get("mantissa_bits") == info.nmant
    )


#: Higher-order primitives whose body receives every operand unchanged.
_WHOLE_OPERAND_BODIES = frozenset(
    {"checkpoint", "remat", "remat2", "custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"}
)


def passthrough_operands(eqn, name: str, index: int | None) -> dict[int, int]:
    """``{body input position: operand position}`` for the body inputs of
    ``eqn``'s body ``name`` that hold an operand's value unchanged on every
    iteration: a ``scan``'s constants, a ``cond`` branch's operands, all of a
    ``remat``/custom-derivative body's.  Constant folding looks through them."""
    prim = eqn.primitive.name
    if prim == "scan" and name == "jaxpr":
        n_consts, _ = scan_counts(eqn.params)
        return {i: i for i in range(n_consts)}
    if prim == "cond" and name == "branches":
        return {i: i + 1 for i in range(len(eqn.invars) - 1)}
    if prim in _WHOLE_OPERAND_BODIES and name in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        return {i: i for i in range(len(eqn.invars))}
    return {}


_REMAT_PRIMITIVES = frozenset({"checkpoint", "remat", "remat2"})


def threads_operands(eqn, name: str, index: int | None) -> bool:
    """Whether `with_leading_operands` can give ``eqn``'s body ``name`` more
    operands: a ``scan``'s (as constants: the ``num_consts`` form) or a
    ``remat``'s.  Other bodies (``cond``, ``while``, custom derivatives,
    ``shard_map``) keep their signatures."""
    prim = eqn.primitive.name
    if name != "jaxpr" or index is not None:
        return False
    if prim == "scan":
        return "num_consts" in eqn.params or _flattree() is not None
    return prim in _REMAT_PRIMITIVES


def _flattree():
    """JAX's ``flattree`` module (a scan's ``ft_in`` since JAX 0.11), or None."""
    try:
        from jax._src import flattree
    except ImportError:  # pragma: no cover - JAX < 0.11 (num_consts)
        return None
    return flattree if hasattr(flattree, "pack") and hasattr(flattree, "nones") else None


def with_leading_operands(eqn, new_body, count: int) -> dict:
    """``eqn``'s params with its body (param ``jaxpr``) replaced by
    ``new_body``, whose first ``count`` inputs are new operands bound before
    the equation's own (`threads_operands`): a scan's new loop-invariant
    constants, a remat's new operands."""
    params = dict(eqn.params)
    params["jaxpr"] = new_body
    if eqn.primitive.name == "scan" and "num_consts" in params:
        params["num_consts"] = params["num_consts"] + count
        if "linear" in params:
            params["linear"] = (False,) * count + tuple(params["linear"])
    elif eqn.primitive.name == "scan":  # ft_in: prepended as JAX's own partial eval does
        ft = _flattree()
        consts, carry, xs = params["ft_in"].unpack()
        params["ft_in"] = ft.pack(((ft.nones(count), consts), carry, xs))
    return params


def sliced_operands(eqn, name: str) -> dict[int, int]:
    """``{body input position: operand position}`` for a ``scan`` body's scanned
    inputs: each iteration receives one slice of the operand along its axis 0."""
    if eqn.primitive.name != "scan" or name != "jaxpr":
        return {}
    n_consts, n_carry = scan_counts(eqn.params)
    first = n_consts + n_carry
    return {i: i for i in range(first, len(eqn.invars))}


#: Bodies that a primitive evaluates with its attached constants since JAX 0.11
#: (``ClosedJaxpr`` params before): a rewritten body there may gain constants.
#: Any other body (``remat``'s, ``shard_map``'s...) was an open ``Jaxpr`` and
#: is evaluated with none, so a rewrite must keep it constant-free.
_CLOSED_BODY_PARAMS = frozenset(
    {
        ("scan", "jaxpr"),
        ("while", "cond_jaxpr"),
        ("while", "body_jaxpr"),
        ("cond", "branches"),
        ("jit", "jaxpr"),
        ("pjit", "jaxpr"),
        ("closed_call", "call_jaxpr"),
        ("core_call", "call_jaxpr"),
        ("custom_jvp_call", "call_jaxpr"),
        ("custom_vjp_call", "call_jaxpr"),
        ("custom_vjp_call_jaxpr", "fun_jaxpr"),
    }
)


def rebuild_body(eqn, name: str, original, new_closed):
    """``new_closed`` (a closed jaxpr with ``original``'s signature) in the form
    ``eqn``'s param ``name`` holds ``original``: closed, or open.  Raises
    ValueError when an open body would have to close over constants."""
    if UNIFIED_JAXPR:
        is_open = not original.consts and (eqn.primitive.name, name) not in _CLOSED_BODY_PARAMS
    else:
        is_open = not isinstance(original, _core.ClosedJaxpr)
    if not is_open:
        return new_closed
    jaxpr, consts = closed_parts(new_closed)
    if consts:
        raise ValueError("the rewritten body would close over constants")
    return jaxpr


def bind_equation(eqn, invals, params=None) -> list:
    """Bind ``eqn``'s primitive on ``invals`` (optionally with replaced params),
    keeping its source info and context, as ``eval_jaxpr`` does."""
    if params is None:
        out = _emit_unchanged(eqn, invals)
        if out is not None:
            return out
    params = eqn.params if params is None else params
    bind_params = eqn.primitive.get_bind_params(params)
    subfuns: tuple = ()
    if isinstance(bind_params, tuple):  # JAX < 0.10 returned (subfuns, params)
        subfuns, bind_params = bind_params
    name_stack = _siu.current_name_stack() + eqn.source_info.name_stack
    with _siu.user_context(eqn.source_info.traceback, name_stack=name_stack), eqn.ctx.manager:
        out = eqn.primitive.bind(*subfuns, *invals, **bind_params)
    return list(out) if eqn.primitive.multiple_results else [out]


def _emit_signature_ok() -> bool:
    try:
        names = list(inspect.signature(_pe.DynamicJaxprTrace.emit_eqn).parameters)
    except (AttributeError, TypeError, ValueError):
        return False
    return names[:8] == [
        "self",
        "in_tracers",
        "out_avals",
        "primitive",
        "params",
        "effects",
        "source_info",
        "ctx",
    ]


_CAN_EMIT = _emit_signature_ok()
# Literal operands become tracers as ``inline_jaxpr_into_trace`` makes them.
_CAN_EMIT_LITERALS = _CAN_EMIT and list(
    inspect.signature(_pe.DynamicJaxprTracer.__init__).parameters
)[:4] == ["self", "trace", "aval", "val"]


def _emit_unchanged(eqn, invals):
    """Stage ``eqn`` as written into the current jaxpr trace, or None.

    When an equation is re-staged unchanged onto tracers whose types are the
    ones it was traced with, its output types are known: skipping ``bind``'s
    abstract evaluation and staging rules makes re-tracing a large model ~3x
    cheaper (the rewrite re-traces every equation, see rewrite.py).  Anything
    unusual (constants, effects, another trace, a changed type) takes
    the general ``bind`` path.
    """
    if not _CAN_EMIT or eqn.effects:
        return None
    trace = _core.trace_ctx.trace
    if type(trace) is not _pe.DynamicJaxprTrace:
        return None
    src = eqn.source_info.replace(name_stack=_siu.current_name_stack() + eqn.source_info.name_stack)
    tracers = list(invals)
    for i, (x, var) in enumerate(zip(invals, eqn.invars, strict=True)):
        if type(var) is _core.Literal:
            if not _CAN_EMIT_LITERALS:
                return None
            tracers[i] = _pe.DynamicJaxprTracer(trace, var.aval, var, src)
        elif type(x) is not _pe.DynamicJaxprTracer or x._trace is not trace or x.aval != var.aval:
            return None
    return trace.emit_eqn(
        tracers,
        [v.aval for v in eqn.outvars],
        eqn.primitive,
        eqn.params,
        eqn.effects,
        src,
        eqn.ctx,
    )


def eval_jaxpr(jaxpr, consts, *args):
    return _core.eval_jaxpr(jaxpr, consts, *args)


def jaxpr_as_fun(closed_jaxpr):
    """``closed_jaxpr`` as a function, like ``jax.core.jaxpr_as_fun``, whose
    equations are re-staged with `bind_equation` (so tracing it under ``jit``
    takes the fast path that re-emits unchanged equations)."""

    jaxpr, consts = closed_parts(closed_jaxpr)

    def fun(*args):
        return _eval_jaxpr(jaxpr, consts, args)

    return fun


def _eval_jaxpr(jaxpr, consts, args) -> list:
    env: dict = {}

    def read(atom):
        return atom.val if type(atom) is _core.Literal else env[atom]

    for var, value in zip(jaxpr.constvars, consts, strict=True):
        env[var] = value
    for var, value in zip(jaxpr.invars, args, strict=True):
        env[var] = value
    for eqn in jaxpr.eqns:
        outs = bind_equation(eqn, [read(a) for a in eqn.invars])
        for var, value in zip(eqn.outvars, outs, strict=True):
            if type(var) is not DropVar:
                env[var] = value
    return [read(v) for v in jaxpr.outvars]


def dce_closed_jaxpr(closed, used_outputs=None):
    """Remove dead equations, keeping every input and the outputs flagged in
    ``used_outputs`` (default: all of them, the signature).  The equations and
    variables kept are the original's."""
    jaxpr, consts = closed_parts(closed)
    # JAX < 0.10 takes one bool per output (no bare ``True`` shorthand).
    used = [True] * len(jaxpr.outvars) if used_outputs is None else list(used_outputs)
    # Since JAX 0.11 the constants stay attached (dce_jaxpr keeps them).
    new, _ = _pe.dce_jaxpr(jaxpr, used, instantiate=True)
    new, consts = _read_constants(new, consts)
    return new if UNIFIED_JAXPR else closed_jaxpr(new, consts)


def _read_constants(jaxpr, consts) -> tuple:
    """``(jaxpr, consts)`` without the constants no equation or output reads.
    JAX's `dce_jaxpr` keeps every ``constvar``: a constant only dead
    equations read (a causal buffer a rewritten site no longer slices) would
    stay held by the closed jaxpr.  Since JAX 0.11 the values are attached to
    the jaxpr and replaced with its ``constvars``; where that API differs,
    the constants are kept (nothing reads them)."""
    read = {id(v) for eqn in jaxpr.eqns for v in eqn.invars if isinstance(v, _core.Var)}
    read |= {id(v) for v in jaxpr.outvars if isinstance(v, _core.Var)}
    kept = [(v, c) for v, c in zip(jaxpr.constvars, consts, strict=True) if id(v) in read]
    if len(kept) == len(jaxpr.constvars):
        return jaxpr, consts
    constvars, values = [v for v, _ in kept], [c for _, c in kept]
    if not UNIFIED_JAXPR:
        return jaxpr.replace(constvars=constvars), values
    try:
        return jaxpr.replace(constvars=constvars, consts=values), values
    except (TypeError, ValueError):
        return jaxpr, consts


def dce_loop_bodies(closed):
    """``closed`` with the dead equations of every ``while`` body removed, at
    any depth (inside ``jit``, ``scan``, ``cond``... bodies too); the loops'
    signatures are kept.  JAX's `dce_closed_jaxpr` has no rule for ``while``:
    it keeps a loop whole, so a value its body computes and drops (attention
    weights a layer returns and its caller ignores) would stay used.  Run it
    before `dce_closed_jaxpr`, which then prunes the ``jit`` outputs such a
    body no longer reads.  Unchanged bodies are kept as they are (identity)."""
    jaxpr, consts = closed_parts(closed)
    new = _clean_loops(jaxpr)
    if new is jaxpr:
        return closed
    return new if UNIFIED_JAXPR else closed_jaxpr(new, consts)


def _clean_loops(jaxpr):
    eqns, changed = [], False
    for eqn in jaxpr.eqns:
        new_bodies = {}
        for name, index, body in bodies_in_params(eqn.params):
            loop_body = eqn.primitive.name == "while" and name == "body_jaxpr"
            new = _clean_body(body, loop_body)
            if new is not body:
                new_bodies[(name, index)] = new
        if new_bodies:
            eqn = eqn.replace(params=replace_bodies(eqn.params, new_bodies))
            changed = True
        eqns.append(eqn)
    return jaxpr.replace(eqns=eqns) if changed else jaxpr


def _clean_body(body, dce: bool):
    jaxpr, consts = closed_parts(body)
    new = _clean_loops(jaxpr)
    if dce:  # every output is the next iteration's carry: all used
        pruned, _ = _pe.dce_jaxpr(new, [True] * len(new.outvars), instantiate=True)
        if len(pruned.eqns) != len(new.eqns) or pruned.eqns != new.eqns:
            new = pruned
    if new is jaxpr:
        return body
    if UNIFIED_JAXPR:
        return new
    return closed_jaxpr(new, consts) if isinstance(body, _core.ClosedJaxpr) else new


# --------------------------------------------------------------------------- source info


def user_location(eqn) -> str | None:
    """``"file.py:LINE"`` of the innermost user frame that created ``eqn``."""
    frame = _siu.user_frame(eqn.source_info.traceback)
    if frame is None:
        return None
    return f"{frame.file_name}:{frame.start_line}"


def user_frames(eqn) -> list[tuple[str, int]]:
    """All user frames (innermost first) that created ``eqn``."""
    return [(f.file_name, f.start_line) for f in _siu.user_frames(eqn.source_info.traceback)]


# --------------------------------------------------------------------------- evaluation helpers


@contextlib.contextmanager
def compile_time_eval():
    """Context in which JAX ops run eagerly on concrete values, whatever trace
    is active around the pass (an outer ``jit``, ``scan``, ``shard_map``...).

    ``jax.ensure_compile_time_eval`` only folds ops whose operands are all
    concrete while the outer trace stays current; an equation re-emitted
    into that trace (`bind_equation`'s fast path, a literal operand) would
    still be staged.  Making the eager evaluation trace current rules that out.
    """
    with _core.set_current_trace(_core.eval_trace), jax.ensure_compile_time_eval():
        yield


def evaluate_equation(eqn, invals) -> list:
    """``eqn`` evaluated eagerly on concrete ``invals`` (constant folding): in
    NumPy where `_host` computes it exactly (no XLA program is compiled, nor
    kept in JAX's caches, per folded shape), else by binding its primitive."""
    host = _host.evaluate(eqn, invals)
    if host is not None:
        return host
    with compile_time_eval():
        return bind_equation(eqn, invals)


# --------------------------------------------------------------------------- argument types


def struct_aval(struct):
    """The abstract value ``jit`` gives a `jax.ShapeDtypeStruct` argument."""
    return _core.shaped_abstractify(struct)
