"""Every JAX-version difference and every private or experimental JAX import.

flashpass touches JAX internals (jaxpr data structures, source info, DCE) and
experimental modules (Pallas kernels).  They all go through this module, so a
JAX upgrade that moves something breaks here, loudly, and nowhere else.

Supported: JAX 0.9.x to 0.12.x (CI runs the version in constraints.txt, the
oldest, 0.9.0, and the newest, 0.12.0.1).  tests/test_compat.py has one test
per private or experimental API used here: when a JAX release moves one, that
test names it and the installed version.
"""

from __future__ import annotations

import contextlib
import functools
import inspect

import jax

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


def dce_closed_jaxpr(closed):
    """Remove dead equations, keeping every input and output (the signature)."""
    jaxpr, consts = closed_parts(closed)
    # JAX < 0.10 takes one bool per output (no bare ``True`` shorthand).
    used = [True] * len(jaxpr.outvars)
    # Since JAX 0.11 the constants stay attached (constvars are never pruned).
    new, _ = _pe.dce_jaxpr(jaxpr, used, instantiate=True)
    return new if UNIFIED_JAXPR else closed_jaxpr(new, consts)


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
    """``eqn`` evaluated eagerly on concrete ``invals`` (constant folding)."""
    with compile_time_eval():
        return bind_equation(eqn, invals)


# --------------------------------------------------------------------------- Pallas


@functools.cache
def tpu_flash_attention_module():
    """``jax.experimental.pallas.ops.tpu.flash_attention`` (imported lazily)."""
    from jax.experimental.pallas.ops.tpu import flash_attention

    return flash_attention


@contextlib.contextmanager
def tpu_interpret_mode():
    """Run Pallas TPU kernels in interpret mode (on CPU) inside this context."""
    from jax.experimental.pallas import tpu as pltpu

    with pltpu.force_tpu_interpret_mode():
        yield


# --- Pallas TPU adapter helpers


@contextlib.contextmanager
def _pallas_tpu_trace_context(interpret: bool):
    with contextlib.ExitStack() as stack:
        # The TPU flash kernel's index maps break under x64 (lax.select of an
        # int32 program id and an int64 literal); its inputs are 32-bit anyway.
        stack.enter_context(jax.enable_x64(False))
        if interpret:
            stack.enter_context(tpu_interpret_mode())
        yield


def pallas_tpu_traced(fn, *, interpret: bool = False):
    """Wrap ``fn`` so the Pallas TPU kernels it calls, including those of its
    backward pass, are traced with x64 off and, if ``interpret``, in interpret mode.

    Both settings are read when ``pallas_call`` is *traced*: `tpu_interpret_mode`
    becomes the call's ``interpret`` parameter (lowering and compiling do not
    consult it).  A ``custom_vjp``'s backward is traced later, when the caller
    differentiates, possibly outside any context, so the contexts are entered
    here in the primal, forward and backward rules.  ``fn`` takes and returns
    arrays only; the wrapper has reverse-mode AD only.
    """

    @jax.custom_vjp
    def call(*args):
        with _pallas_tpu_trace_context(interpret):
            return fn(*args)

    def fwd(*args):
        with _pallas_tpu_trace_context(interpret):
            out, vjp = jax.vjp(fn, *args)
        return out, vjp  # `vjp` is a pytree of residual arrays (a tree_util.Partial).

    def bwd(vjp, cotangent):
        with _pallas_tpu_trace_context(interpret):
            return vjp(cotangent)

    call.defvjp(fwd, bwd)
    return call


def lower_for_tpu(fn, *args) -> str:
    """StableHLO text of ``fn(*args)`` lowered for TPU, on any host (no TPU needed).

    ``args`` may be arrays or `jax.ShapeDtypeStruct`s.  Pallas TPU kernels
    appear as ``tpu_custom_call`` custom calls.  Uses `jax.export`, whose
    ``platforms`` argument is the public way to cross-lower.
    """
    from jax import export

    exported = export.export(jax.jit(fn), platforms=["tpu"])(*args)
    return exported.mlir_module()


# --------------------------------------------------------------------------- MLIR


def stablehlo_ops(module) -> list[tuple[str, list[tuple[int, ...]], str | None]]:
    """``(op name, result tensor shapes, custom-call target)`` for every operation
    of a StableHLO module (``Lowered.compiler_ir("stablehlo")``), using the MLIR
    Python bindings that ship in jaxlib."""
    from jaxlib.mlir import ir

    found = []

    def visit(op) -> None:
        shapes = []
        for result in op.results:
            try:
                shapes.append(tuple(ir.RankedTensorType(result.type).shape))
            except (ValueError, TypeError):  # not a ranked tensor (token, tuple...)
                pass
        target = None
        if op.name == "stablehlo.custom_call" and "call_target_name" in op.attributes:
            target = ir.StringAttr(op.attributes["call_target_name"]).value
        found.append((op.name, shapes, target))
        for region in op.regions:
            for block in region.blocks:
                for inner in block.operations:
                    visit(inner.operation)

    with module.context:
        for op in module.body.operations:
            visit(op.operation)
    return found


def parse_stablehlo(text: str):
    """Parse StableHLO text (e.g. from `lower_for_tpu`) into an MLIR module."""
    from jax._src.interpreters import mlir as jax_mlir
    from jaxlib.mlir import ir

    context = jax_mlir.make_ir_context()
    return ir.Module.parse(text, context=context)


# --- kernel adapters (issue 4)


@functools.cache
def splash_attention_module():
    """``jax.experimental.pallas.ops.tpu.splash_attention`` (imported lazily)."""
    from jax.experimental.pallas.ops.tpu import splash_attention

    return splash_attention


def splash_chunked_causal_mask(shape, chunk_size: int):
    """Splash's ``ChunkedCausalMask`` (not exported by the package's
    ``__init__``: read from its ``splash_attention_mask`` module)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask

    return splash_attention_mask.ChunkedCausalMask(shape, chunk_size=chunk_size)


def make_splash_kernel(mask, **kwargs):
    """``splash_attention.make_splash_mha(mask, **kwargs)``, usable inside a trace.

    ``mask`` is a static ``MultiHeadMask`` or a traced boolean ``[heads, T, S]``
    array.  ``make_splash_mha`` turns every `MaskInfo` field, including the
    Python flag ``is_dynamic_mask``, into an array; inside ``jit``/``vmap`` that
    flag is a tracer and the kernel's ``if mask_info.is_dynamic_mask`` (it only
    picks a ``named_scope``) fails.  The flag is restored to a Python bool.
    """
    sa = splash_attention_module()
    kernel = sa.make_splash_mha(mask, **kwargs)
    dynamic = not isinstance(mask, sa.MultiHeadMask)
    for name in ("fwd_mask_info", "dq_mask_info", "dkv_mask_info"):
        info = getattr(kernel, name)
        if info is not None:
            setattr(kernel, name, info._replace(is_dynamic_mask=dynamic))
    return kernel


@functools.cache
def gpu_attention_module():
    """``jax.experimental.pallas.ops.gpu.attention`` (the Triton flash attention)."""
    from jax.experimental.pallas.ops.gpu import attention

    return attention


def traced_with(fn, make_context):
    """Wrap ``fn`` (arrays in, arrays out) so that it, its forward and its
    backward are traced inside ``make_context()``.

    Settings such as ``jax.enable_x64`` or ``jax.default_matmul_precision`` are
    read when a kernel is *traced*; a ``custom_vjp`` backward is traced later,
    when the caller differentiates, outside any context the adapter entered, so
    the context is entered in the primal, forward and backward rules (as
    `pallas_tpu_traced` does).  Reverse-mode AD only.
    """

    @jax.custom_vjp
    def call(*args):
        with make_context():
            return fn(*args)

    def fwd(*args):
        with make_context():
            out, vjp = jax.vjp(fn, *args)
        return out, vjp

    def bwd(vjp, cotangent):
        with make_context():
            return vjp(cotangent)

    call.defvjp(fwd, bwd)
    return call


def _cudnn_attention_module():
    from jax._src.cudnn import fused_attention_stablehlo

    return fused_attention_stablehlo


_ASSUMED_CUDNN: list[int] = []


def cudnn_version() -> int | None:
    """The cuDNN version JAX's fused attention would use (e.g. ``90800``), or
    None when this jaxlib has no CUDA support (a CPU-only install)."""
    if _ASSUMED_CUDNN:
        return _ASSUMED_CUDNN[-1]
    try:
        from jax._src.lib import cuda_versions
    except ImportError:  # pragma: no cover - very old/new jaxlib layouts
        return None
    if cuda_versions is None:
        return None
    try:
        return int(cuda_versions.cudnn_get_version())
    except Exception:  # no usable cuDNN library
        return None


@contextlib.contextmanager
def assume_cudnn(version: int = 90800):
    """Trace and lower cuDNN attention on a host without CUDA (tests, previews).

    JAX's ``dot_product_attention(implementation="cudnn")`` asks the CUDA
    plugin for the cuDNN version while tracing and fails without one; inside
    this context that question is answered with ``version`` (so are
    `cudnn_version` and the checks that depend on it).  Nothing can *run*.
    """
    module = _cudnn_attention_module()
    original = module.check_cudnn_version
    module.check_cudnn_version = lambda: version
    _ASSUMED_CUDNN.append(version)
    try:
        yield
    finally:
        _ASSUMED_CUDNN.pop()
        module.check_cudnn_version = original


def gpu_compute_capability() -> tuple[int, int] | None:
    """Compute capability of the first local CUDA GPU, or None without one."""
    try:
        devices = jax.local_devices(backend="gpu")
    except RuntimeError:
        return None
    for device in devices:
        capability = getattr(device, "compute_capability", None)
        if capability:
            major, _, minor = str(capability).partition(".")
            return int(major), int(minor or 0)
    return None


def lower_for_gpu(fn, *args) -> str:
    """StableHLO text of ``fn(*args)`` lowered for CUDA, on any host (no GPU needed).

    Pallas Triton kernels appear as ``__gpu$xla.gpu.triton`` custom calls and
    cuDNN attention as ``__cudnn$fmha...`` ones.  Uses `jax.export` with its
    custom-call stability check disabled (the module is inspected, never
    serialised).  cuDNN attention additionally needs `assume_cudnn` on a host
    without CUDA.
    """
    if JAX_VERSION < (0, 10):  # export has no "ALL" custom-call wildcard: lower directly
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    from jax import export

    def lower():
        return export.export(
            jax.jit(fn),
            platforms=["cuda"],
            disabled_checks=[export.DisabledSafetyCheck.custom_call("ALL")],
        )(*args).mlir_module()

    try:
        return lower()
    except RuntimeError as err:
        # JAX >= 0.11 lowers Pallas Triton kernels for a device it asks for its
        # compute capability.  (An abstract mesh cannot be set up front: cuDNN
        # attention refuses to lower under one.)
        if "AbstractDevice" not in str(err) or gpu_compute_capability() is not None:
            raise
    with _abstract_gpu():
        return lower()


#: The GPU `lower_for_gpu` lowers for on a host without one.
ASSUMED_GPU_KIND = "NVIDIA H100"


def _abstract_gpu():
    """Context that makes ``ASSUMED_GPU_KIND`` the device to lower for, on a
    host without a GPU: since JAX 0.11 the Pallas Triton lowering asks the
    device (or the abstract mesh's `jax.sharding.AbstractDevice`) for its
    compute capability."""
    device = jax.sharding.AbstractDevice(
        device_kind=ASSUMED_GPU_KIND, num_cores=None, platform="gpu"
    )
    mesh = jax.sharding.AbstractMesh((1,), ("_gpu",), abstract_device=device)
    return jax.sharding.use_abstract_mesh(mesh)


def tokamax_module():
    """The ``tokamax`` package when it is installed, else None (never required)."""
    import importlib.util

    if importlib.util.find_spec("tokamax") is None:
        return None
    import tokamax

    return tokamax


# --- sharding (issue 6)

#: Primitives that only change a value's type (its varying manual axes inside
#: ``shard_map``), never its value: constant folding looks through them.
VALUE_IDENTITY_PRIMITIVES = frozenset({"pvary"})


def named_sharding_of(aval):
    """``aval``'s `NamedSharding` when it lives on a mesh of more than one
    device, else None (unsharded, single device, or no sharding at all)."""
    sharding = getattr(aval, "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or mesh.empty or mesh.size <= 1:
        return None
    return sharding


def traced_sharding(aval):
    """The sharding to re-trace ``aval`` with (`jax.ShapeDtypeStruct`'s
    ``sharding``): its `NamedSharding` on a mesh of several devices unless some
    mesh axis is manual (a ``shard_map`` body), else None."""
    sharding = named_sharding_of(aval)
    if sharding is None or axis_kinds(sharding.mesh).get("manual"):
        return None
    return sharding


def context_mesh():
    """The abstract mesh of the current trace context (``jax.set_mesh``,
    ``shard_map`` bodies); empty when none is set."""
    return jax.sharding.get_abstract_mesh()


def axis_kinds(mesh) -> dict[str, tuple[str, ...]]:
    """``{"explicit": names, "auto": names, "manual": names}`` of ``mesh``'s
    axes of more than one device."""
    kinds: dict[str, list[str]] = {"explicit": [], "auto": [], "manual": []}
    if mesh is None or mesh.empty:
        return {k: () for k in kinds}
    types = getattr(mesh, "axis_types", None) or (jax.sharding.AxisType.Auto,) * len(
        mesh.axis_names
    )
    for name, kind in zip(mesh.axis_names, types, strict=True):
        if mesh.shape[name] > 1:
            kinds[str(kind.name).lower()].append(name)
    return {k: tuple(v) for k, v in kinds.items()}


def shard_map(fn, *, mesh, in_specs, out_specs, axis_names, check_vma: bool):
    """`jax.shard_map` (public since JAX 0.7; ``check_vma`` was ``check_rep``)."""
    return jax.shard_map(
        fn,
        mesh=mesh,
        in_specs=in_specs,
        out_specs=out_specs,
        axis_names=frozenset(axis_names),
        check_vma=check_vma,
    )


def reshard(x, sharding):
    """`jax.sharding.reshard` of ``x`` to ``sharding`` (Explicit mesh axes)."""
    return jax.sharding.reshard(x, sharding)


def is_shard_map(eqn) -> bool:
    return eqn.primitive.name == "shard_map"


def shard_map_params(eqn) -> dict:
    """A ``shard_map`` equation's arguments to `shard_map`, and its body."""
    p = eqn.params
    return {
        "mesh": p["mesh"],
        "in_specs": tuple(p["in_specs"]),
        "out_specs": tuple(p["out_specs"]),
        # JAX < 0.10 calls the equation's param ``manual_axes``.
        "axis_names": frozenset(
            p["newly_manual_axes"] if "newly_manual_axes" in p else p["manual_axes"]
        ),
        "check_vma": bool(p["check_vma"]),
        "body": p["jaxpr"],
    }


def varying_axes(x) -> frozenset:
    """The manual mesh axes ``x`` varies over (its type inside a ``shard_map``
    body with ``check_vma=True``); empty elsewhere."""
    aval = jax.typeof(x)
    mat = getattr(aval, "mat", None)
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", ()))


def vma_checks(enabled: bool):
    """Context: trace with ``shard_map``'s varying-manual-axes checks on or off
    (off, primitives give their outputs no varying axes)."""
    from jax._src import config as _config

    return _config._check_vma(enabled)


@contextlib.contextmanager
def equation_context(eqn):
    """The source info and context ``bind_equation`` binds ``eqn`` in, for
    re-binding it through a public API instead (e.g. `shard_map`)."""
    name_stack = _siu.current_name_stack() + eqn.source_info.name_stack
    with _siu.user_context(eqn.source_info.traceback, name_stack=name_stack), eqn.ctx.manager:
        yield


# --------------------------------------------------------------------------- argument types


def struct_aval(struct):
    """The abstract value ``jit`` gives a `jax.ShapeDtypeStruct` argument."""
    return _core.shaped_abstractify(struct)


@contextlib.contextmanager
def outside_mesh():
    """Trace with no mesh context (no manual axes, no varying-axes checks):
    for work that must not depend on where the pass runs, such as probing a
    kernel from inside a user's ``shard_map`` body."""
    from jax._src import mesh as _mesh

    with jax.sharding.use_abstract_mesh(_mesh.empty_abstract_mesh), vma_checks(False):
        yield
