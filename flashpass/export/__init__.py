"""Rewrite attention in exported StableHLO: `jax.export` artifacts and other frontends' modules.

exp = flashpass.export.load(open("model.bin", "rb").read())
print(flashpass.export.explain(exp))
new = flashpass.export.rewrite(exp)          # an Exported, like any other
open("model.flash.bin", "wb").write(new.serialize(vjp_order=1))

The default route, lift, turns the module's StableHLO into a JAX function op
by op, runs `flashpass.optimize` on it and exports the result again, so the
rewritten artifact's derivative is JAX's (the kernels' own backward).
"""

from __future__ import annotations

import jax

from flashpass import compat

from .api import explain, rewrite, rewrite_and_explain
from .lift import LiftedModule, prepare
from .ops import rule_names
from .report import ExportReport
from .values import LiftError, x64_scope_for

__all__ = [
    "ExportReport",
    "LiftError",
    "explain",
    "load",
    "rewrite",
    "rewrite_and_explain",
    "rule_names",
]


def load(data: bytes | str, *, platforms=None) -> jax.export.Exported:
    """An `Exported` from ``data``: bytes of ``Exported.serialize()``, a StableHLO
    portable artifact, MLIR bytecode, or MLIR text.

    A bare module (not a serialized `Exported`) takes the input and output
    types of its ``main``; ``platforms`` says where it may run (default: the
    current backend).
    """
    if isinstance(data, bytes | bytearray) and not bytes(data).startswith(b"ML\xefR"):
        try:
            return jax.export.deserialize(bytearray(data))
        except Exception as err:  # not a flatbuffer: try MLIR text below
            try:
                data = bytes(data).decode("utf-8")
            except UnicodeDecodeError:
                raise ValueError(
                    "data is neither a serialized Exported, a StableHLO artifact, MLIR "
                    f"bytecode nor MLIR text ({type(err).__name__}: {err})"
                ) from None
    return _from_module(data, platforms)


def _from_module(data, platforms) -> jax.export.Exported:
    context = compat.mlir_context()
    try:
        module = compat.parse_module(data, context)
    except Exception as err:
        raise ValueError(f"could not parse the module: {err}") from None
    lifted: LiftedModule = prepare(module)
    if platforms is None:
        if lifted.has_platform_index:
            raise ValueError("this module takes a platform index: pass platforms=(...)")
        platforms = (jax.default_backend(),)
    platforms = tuple(platforms)
    if (len(platforms) > 1) != lifted.has_platform_index:
        raise ValueError(
            f"platforms={platforms} does not fit the module: its main "
            + ("takes" if lifted.has_platform_index else "does not take")
            + " a platform index"
        )
    with x64_scope_for(str(module)):  # int64 inputs stay int64 (torch_xla's tokens)
        return compat.exported_from_module(
            compat.module_to_artifact(module),
            fun_name="main",
            in_avals=lifted.in_avals,
            out_avals=lifted.out_avals,
            platforms=platforms,
        )
