"""Values of the lifter: MLIR types to JAX avals, constants to numpy, splats kept lazy."""

from __future__ import annotations

import contextlib
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from flashpass import compat

_ELEMENT_TYPES = {
    "i1": np.dtype(bool),
    "i8": np.dtype(np.int8),
    "i16": np.dtype(np.int16),
    "i32": np.dtype(np.int32),
    "i64": np.dtype(np.int64),
    "ui8": np.dtype(np.uint8),
    "ui16": np.dtype(np.uint16),
    "ui32": np.dtype(np.uint32),
    "ui64": np.dtype(np.uint64),
    "f16": np.dtype(np.float16),
    "bf16": np.dtype(jnp.bfloat16),
    "f32": np.dtype(np.float32),
    "f64": np.dtype(np.float64),
    "f8E4M3FN": np.dtype(jnp.float8_e4m3fn),
    "f8E5M2": np.dtype(jnp.float8_e5m2),
    "complex<f32>": np.dtype(np.complex64),
    "complex<f64>": np.dtype(np.complex128),
}


#: A tensor type with 64-bit elements (what JAX without x64 would narrow to 32 bits).
_WIDE_TENSOR = re.compile(r"tensor<(?:[0-9?]+x)*(?:i64|ui64|f64|complex<f64>)>")


def x64_scope_for(module_text: str):
    """A context in which the module's 64-bit types stay 64-bit: x64 on while
    lifting, tracing and exporting a module that holds any (``jax.export``
    records them as they are, so the result keeps the artifact's avals), and
    nothing otherwise or where x64 is on already."""
    if compat.x64_enabled() or not _WIDE_TENSOR.search(module_text):
        return contextlib.nullcontext()
    return compat.x64_scope(True)


class LiftError(Exception):
    """The module cannot be lifted (the message says which op and why)."""


def tensor_aval(mlir_type) -> jax.ShapeDtypeStruct:
    """The aval of a ranked, static ``tensor<...>`` type."""
    ir = compat.ir_module()
    try:
        ranked = ir.RankedTensorType(mlir_type)
    except (ValueError, TypeError):
        raise LiftError(
            f"type {mlir_type} is not a ranked tensor (tokens are not lifted)"
        ) from None
    if not ranked.has_static_shape:
        raise LiftError(f"type {mlir_type} has a dynamic shape (shape polymorphism is not lifted)")
    name = str(ranked.element_type)
    if name not in _ELEMENT_TYPES:
        raise LiftError(f"element type {name} is not supported")
    return jax.ShapeDtypeStruct(tuple(ranked.shape), _ELEMENT_TYPES[name])


@dataclasses.dataclass(frozen=True)
class Splat:
    """A constant with one value everywhere, kept as a scalar until an op needs
    the array, so ``x / 8.0`` lifts to a scalar operand as in a traced program
    instead of a materialised T×S constant."""

    value: np.ndarray  # 0-d
    shape: tuple

    @property
    def dtype(self):
        return self.value.dtype

    def array(self):
        return lax.full(self.shape, self.value, self.value.dtype)

    def reshaped(self, shape) -> Splat:
        return Splat(self.value, tuple(shape))


def materialize(x):
    """An array for ``x`` (a traced value, a numpy constant or a `Splat`)."""
    return x.array() if isinstance(x, Splat) else x


def constant_value(x) -> np.ndarray | None:
    """The numpy value of a known constant, else None."""
    if isinstance(x, Splat):
        return np.broadcast_to(x.value, x.shape)
    if isinstance(x, np.ndarray):
        return x
    return None


def dense_constant(attr, aval) -> Splat | np.ndarray:
    """The value of a ``dense<...>`` attribute of type ``aval``."""
    ir = compat.ir_module()
    try:
        dense = ir.DenseElementsAttr(attr)
    except (ValueError, TypeError):
        raise LiftError(f"constant {str(attr)[:80]} is not a dense elements attribute") from None
    dtype = aval.dtype
    if dense.is_splat:
        scalar = _parse_dense_text(str(dense.get_splat_value()).split(" : ")[0], dtype)
        return Splat(np.asarray(scalar.reshape(()), dtype), tuple(aval.shape))
    try:
        value = np.array(dense)
        if value.dtype == dtype and value.size == int(np.prod(aval.shape)):
            return value.reshape(aval.shape)
    except (ValueError, TypeError, RuntimeError):
        pass  # bfloat16 and other types numpy's buffer protocol cannot read
    text = str(dense)
    body = text[text.index("<") + 1 : text.rindex("> :")]
    return _parse_dense_text(body, dtype).reshape(aval.shape)


def _parse_dense_text(body: str, dtype: np.dtype) -> np.ndarray:
    """Elements printed by MLIR: a hex blob, a nested list or one scalar."""
    body = body.strip()
    if body.startswith('"0x'):
        raw = bytes.fromhex(body[3:-1])
        if dtype == np.dtype(bool):
            return np.frombuffer(raw, np.uint8).astype(bool)
        return np.frombuffer(raw, dtype).copy()
    tokens = [t for t in re.split(r"[\[\],\s]+", body) if t]
    return np.array([_scalar(t, dtype) for t in tokens]).astype(dtype)


def _scalar(token: str, dtype: np.dtype):
    if token in ("true", "false"):
        return token == "true"
    if token.startswith("0x") and jnp.issubdtype(dtype, jnp.floating):
        bits = np.array(int(token, 16), np.dtype(f"uint{dtype.itemsize * 8}"))
        return bits.view(dtype)
    if jnp.issubdtype(dtype, jnp.floating):
        return np.array(float(token), dtype)
    return int(token, 0)
