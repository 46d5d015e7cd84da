"""Pallas, splash, cuDNN and cross-platform lowering (see compat/__init__.py)."""

from __future__ import annotations

import contextlib
import functools
import math

import jax

from ._jaxpr import JAX_VERSION

#: Every experimental JAX module flashpass imports (all of them here, lazily),
#: with the JAX versions where each is known to exist: ``(first, last)``, the
#: range CI runs (0.9.0, the pinned version, 0.12.0.1).  A new release that
#: moves one fails `tests/test_compat.py`, which also checks that this table
#: lists exactly the modules imported.
EXPERIMENTAL_MODULES = {
    "jax.experimental.pallas": ("0.9.0", "0.12.0.1"),
    "jax.experimental.pallas.tpu": ("0.9.0", "0.12.0.1"),
    "jax.experimental.pallas.triton": ("0.9.0", "0.12.0.1"),
    "jax.experimental.pallas.ops.tpu.flash_attention": ("0.9.0", "0.12.0.1"),
    "jax.experimental.pallas.ops.tpu.paged_attention": ("0.9.0", "0.12.0.1"),
    "jax.experimental.pallas.ops.tpu.splash_attention": ("0.9.0", "0.12.0.1"),
    "jax.experimental.pallas.ops.tpu.splash_attention.splash_attention_mask": (
        "0.9.0",
        "0.12.0.1",
    ),
    "jax.experimental.pallas.ops.tpu.splash_attention.splash_attention_kernel": (
        "0.9.0",
        "0.12.0.1",
    ),
    # Deprecated from JAX 0.11.1 (in favour of tokamax): imported only before it
    # (`TRITON_ATTENTION`), though it still exists in 0.12.
    "jax.experimental.pallas.ops.gpu.attention": ("0.9.0", "0.11.0"),
    # Placement decided by XLA's partitioner (_partitioning.py).
    "jax.experimental.custom_partitioning": ("0.9.0", "0.12.0.1"),
}

#: Whether this JAX's Triton flash attention (``pallas.ops.gpu.attention``) may
#: be used: JAX 0.11.1 deprecates the module (in favour of tokamax) and 0.11.2
#: the Pallas Triton backend itself (in favour of Mosaic GPU).  `pallas_gpu`
#: runs only before them.  Mosaic GPU is no drop-in: a generic ``pallas_call``
#: on GPU still lowers through Triton (JAX 0.12 has no Mosaic GPU rule for it,
#: only ``mosaic_gpu.kernel``), and Mosaic GPU lowers no ``dot_general``
#: (matmuls are the architecture's ``wgmma``, ``tcgen05_mma`` or ``mma``).
TRITON_ATTENTION = JAX_VERSION < (0, 11, 1)

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


@functools.cache
def pallas_tpu_modules():
    """``(jax.experimental.pallas, jax.experimental.pallas.tpu)``, for kernels
    of our own written in Pallas (`flashpass.kernels.flash_tpu`)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    return pl, pltpu


@functools.cache
def pallas_triton_modules():
    """``(jax.experimental.pallas, jax.experimental.pallas.triton)``: Pallas
    kernels of our own lowered through Triton on GPU (`flashpass.kernels.flash_gpu`;
    deprecated by JAX 0.11.2, see `TRITON_ATTENTION`)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    return pl, plgpu


@functools.cache
def tpu_paged_attention_module():
    """``jax.experimental.pallas.ops.tpu.paged_attention`` (the TPU decode kernel)."""
    from jax.experimental.pallas.ops.tpu import paged_attention

    return paged_attention


@contextlib.contextmanager
def pallas_tpu_context(interpret: bool):
    """What tracing a Pallas TPU kernel needs: x64 off and, if ``interpret``,
    TPU interpret mode (see `pallas_tpu_traced`)."""
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
    return traced_with(fn, lambda: pallas_tpu_context(interpret))


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


# --- kernel adapters


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


def splash_backward(kernel, res, do):
    """Splash attention's backward from given residuals ``res = (q, k, v,
    segment_ids, out, logsumexp)`` of one example (``[H, T, D]``, the natural
    logsumexp ``[H, T]``) for ``kernel`` (a `make_splash_kernel` result): a
    ring step passes the global output and logsumexp, so the gradients are the
    block's share.  JAX's private ``_splash_attention_bwd`` (one signature and
    residual layout from JAX 0.9 to 0.12): ``(dq, dk, dv)``."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk

    q, k, v, segment_ids, out, lse = res
    kw = kernel.kwargs
    residuals = (q, k, v, segment_ids, None, out, lse, kernel.dq_mask_info, kernel.dkv_mask_info)
    options = [kw[name] for name in ("mask_value", "is_mqa", "block_sizes")]
    options += [kw.get(name) for name in ("residual_checkpoint_name", "mask_function")]
    options += [kw.get("attn_logits_soft_cap"), kw.get("interpret", False)]
    grads = sk._splash_attention_bwd(False, *options, residuals, do)
    return grads[3:6]  # (after the three mask infos' None)


@functools.cache
def gpu_attention_module():
    """``jax.experimental.pallas.ops.gpu.attention`` (the Triton flash attention;
    only where `TRITON_ATTENTION`: importing it later warns)."""
    if not TRITON_ATTENTION:
        raise RuntimeError(
            f"JAX {jax.__version__} deprecates jax.experimental.pallas.ops.gpu.attention "
            "and the Pallas Triton backend; flashpass uses them before JAX 0.11.1 only"
        )
    from jax.experimental.pallas.ops.gpu import attention

    return attention


#: The Triton flash attention keeps its logsumexp in base 2 (``m + log2(l)`` of
#: scores times ``log2(e)``; JAX 0.9 to 0.12): this converts it to natural units.
_LOG2_E = math.log2(math.e)


def gpu_attention_with_lse(q, k, v, segment_ids, **options):
    """The Triton flash attention's output and its natural logsumexp
    ``[B, H, T]`` (``mha(..., return_residuals=True)``; layout ``[B, T, H, D]``)."""
    out, lse = gpu_attention_module().mha(q, k, v, segment_ids, return_residuals=True, **options)
    return out, lse / _LOG2_E


def gpu_attention_backward(res, do, *, sm_scale, causal, block_sizes, interpret):
    """The Triton flash attention's backward from given residuals ``res =
    (q, k, v, segment_ids, out, lse)`` (kernel layout ``[B, T, H, D]``, the
    natural logsumexp ``[B, H, T]``): a ring step passes the global output and
    logsumexp, so the gradients are the block's share.  JAX's private
    ``_mha_backward`` (one signature from JAX 0.9 to 0.12): ``(dq, dk, dv, None)``."""
    backward = gpu_attention_module()._mha_backward
    *arrays, lse = res
    # (sm_scale, causal, block_sizes, backward_pass_impl, num_warps, num_stages,
    #  grid, interpret, debug, return_residuals, res, do)
    args = (sm_scale, causal, block_sizes, "triton", None, 2, None, interpret, False, False)
    return backward(*args, (*arrays, lse * _LOG2_E), do)


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


def tokamax_installed() -> bool:
    """Whether the optional ``tokamax`` package is installed (found, not imported:
    importing it takes seconds and imports flax)."""
    import importlib.util

    return importlib.util.find_spec("tokamax") is not None


def tokamax_module():
    """The ``tokamax`` package when it is installed, else None (never required).

    tokamax keeps its options in absl flags and, when nothing has parsed them,
    parses ``sys.argv`` at its first call: any argument absl does not define (a
    program's own, pytest's) then raises ``UnrecognizedFlagError`` while tracing,
    so tokamax would decline every site.  Unparsed flags are marked parsed here,
    keeping tokamax's defaults (tokamax 0.0.12); a program using ``absl.app``
    has parsed its flags already."""
    if not tokamax_installed():
        return None
    import tokamax
    from absl import flags  # a dependency of tokamax

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
    return tokamax


def is_forward_mode_error(err: BaseException) -> bool:
    """Whether ``err`` is JAX's refusal to differentiate a ``custom_vjp``
    forward (``jax.jvp``, ``jax.jacfwd`` or ``jax.linearize`` through a
    kernel with its own backward); JAX 0.9 through 0.12 word it so."""
    return isinstance(err, TypeError) and "forward-mode autodiff" in str(err)
