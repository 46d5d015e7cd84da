"""StableHLO modules and `jax.export.Exported` internals (see compat/__init__.py).

`flashpass.export` reads MLIR through the bindings that ship with jaxlib and
builds `Exported` objects around modules JAX did not export itself.  The MLIR
context with every dialect JAX emits registered, the StableHLO version JAX
serializes to, and the construction of an `Exported` all live here.
"""

from __future__ import annotations

import dataclasses

import jax


def mlir_context():
    """An MLIR context with the dialects JAX emits (stablehlo, chlo, func, sdy, ...)."""
    from jax._src.interpreters import mlir as jax_mlir

    return jax_mlir.make_ir_context()


def ir_module():
    """The ``ir`` module of the MLIR bindings (types, attributes, ``Module``)."""
    from jax.extend.mlir import ir

    return ir


def stablehlo_dialect():
    """The ``stablehlo`` dialect bindings (attribute helpers such as ``DotDimensionNumbers``)."""
    from jax.extend.mlir.dialects import stablehlo

    return stablehlo


def parse_module(data: bytes | str, context):
    """Parse a StableHLO portable artifact, MLIR bytecode or MLIR text."""
    ir = ir_module()
    if isinstance(data, bytes | bytearray):
        data = bytes(data)
        if data.startswith(b"ML\xefR"):
            from jax.extend import mlir as jex_mlir

            try:
                try:
                    module = jex_mlir.deserialize_portable_artifact(data, context)
                except TypeError:  # JAX < 0.10: no context, returns the text
                    module = jex_mlir.deserialize_portable_artifact(data)
            except Exception:
                return ir.Module.parse(data, context=context)  # plain bytecode
            if isinstance(module, str | bytes):
                return ir.Module.parse(module, context=context)
            return module
        data = data.decode("utf-8")
    return ir.Module.parse(data, context=context)


def module_to_artifact(module) -> bytes:
    """Serialize a module the way `jax.export` does (a versioned portable artifact)."""
    from jax._src.export import _export

    return _export._module_to_bytecode(module)


def module_bytecode(module) -> bytes:
    """Plain MLIR bytecode of ``module`` (not a versioned artifact)."""
    import io

    buffer = io.BytesIO()
    module.operation.write_bytecode(buffer)
    return buffer.getvalue()


def exported_from_module(
    module_bytes: bytes,
    *,
    fun_name: str,
    in_avals,
    out_avals,
    platforms,
    in_tree=None,
    out_tree=None,
) -> jax.export.Exported:
    """An `Exported` around a single-device module whose ``main`` takes the
    arrays ``in_avals`` (after a platform index when there are several
    platforms) and returns ``out_avals`` (one result: an array, else a tuple).

    The `Exported` constructor's private fields differ between JAX
    versions, so a trivial function with the same signature is exported and
    its module replaced.
    """
    import jax.numpy as jnp

    outs = tuple(out_avals)

    def shaped(*args):
        del args
        zeros = tuple(jnp.zeros(a.shape, a.dtype) for a in outs)
        return zeros[0] if len(zeros) == 1 else zeros  # one result: no tuple

    args = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in in_avals]
    template = jax.export.export(jax.jit(shaped), platforms=tuple(platforms))(*args)
    changes = dict(
        fun_name=fun_name,
        mlir_module_serialized=module_bytes,
        module_kept_var_idx=tuple(range(len(args))),
        uses_global_constants=len(tuple(platforms)) > 1,
        _get_vjp=None,
    )
    if in_tree is not None:
        changes["in_tree"] = in_tree
    if out_tree is not None:
        changes["out_tree"] = out_tree
    return dataclasses.replace(template, **changes)


def exported_with_vjp(exp: jax.export.Exported, get_vjp) -> jax.export.Exported:
    """``exp`` whose backward is ``get_vjp(exp) -> Exported`` (serialized with ``vjp_order``)."""
    return dataclasses.replace(exp, _get_vjp=get_vjp)


def exported_with_module(exp: jax.export.Exported, module_bytes: bytes) -> jax.export.Exported:
    """``exp`` (same signature, platforms and shardings) running another module,
    with no derivative declared."""
    return dataclasses.replace(exp, mlir_module_serialized=module_bytes, _get_vjp=None)


def func_dialect():
    """The ``func`` dialect bindings (to build a module around one op)."""
    from jaxlib.mlir.dialects import func

    return func


def ir_element_type(dtype):
    """The MLIR element type of a numpy/JAX dtype (must be called inside a context)."""
    from jax._src.interpreters import mlir as jax_mlir

    return jax_mlir.dtype_to_ir_type(dtype)


def x64_enabled() -> bool:
    """Whether 64-bit types are on (``jax_enable_x64``) where this is called."""
    return bool(jax.config.jax_enable_x64)


def x64_scope(enabled: bool = True):
    """A context with ``jax_enable_x64`` set to ``enabled``.  ``jax.enable_x64``
    on every supported JAX (0.9 to 0.12; ``jax.experimental.enable_x64``, its
    older spelling, is gone from 0.10 and 0.12)."""
    return jax.enable_x64(enabled)


def exported_named_shardings(exp: jax.export.Exported):
    """``(in, out)``: the artifact's `NamedSharding`s over abstract meshes
    (``None`` where unspecified), or ``None`` when it records only
    HloShardings (an artifact from a JAX before named shardings)."""
    # JAX 0.12 has named shardings only; JAX 0.10 flags artifacts that have them.
    if not getattr(exp, "_has_named_shardings", hasattr(exp, "_in_named_shardings")):
        return None
    return tuple(exp._in_named_shardings), tuple(exp._out_named_shardings)


def exported_hlo_shardings(exp: jax.export.Exported):
    """``(in, out)``: the artifact's HloShardings, computed from its named
    shardings where it has them (as JAX 0.10's deserializer fills
    ``in_shardings_hlo``/``out_shardings_hlo``; JAX 0.12 leaves those None)."""
    named = exported_named_shardings(exp)
    if named is None:
        return tuple(exp.in_shardings_hlo), tuple(exp.out_shardings_hlo)

    def hlo(shardings, avals):
        return tuple(
            None if s is None else s._to_xla_hlo_sharding(a.ndim)
            for s, a in zip(shardings, avals, strict=True)
        )

    return hlo(named[0], exp.in_avals), hlo(named[1], exp.out_avals)
