"""Layout-only steps of the score chain: dtype casts, transposes and copies.

``scores.astype(jnp.float32)`` before ``jax.nn.softmax`` (mixed precision code:
Flax, Hugging Face) and einsum output permutations change no value the kernel
computes; casts fix the softmax dtype, transposes move axis roles.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from flashpass import compat

from .chain import Step, rule
from .common import Miss, where


@dataclasses.dataclass
class Cast(Step):
    """A float-to-float cast: fixes the softmax dtype, no score op."""

    dtype: np.dtype


@dataclasses.dataclass
class Transpose(Step):
    """A permutation of the score axes: moves axis roles."""

    perm: tuple

    def permutation(self) -> tuple:
        return self.perm

    def apply(self, build) -> None:
        build.permute(self.perm)


@dataclasses.dataclass
class Identity(Step):
    """A value-preserving copy."""


@rule("convert_element_type")
def _cast(scope, node, out):
    src, dst = scope.dtype(node.ins[0]), np.dtype(node.params["new_dtype"])
    if not (jnp.issubdtype(src, jnp.floating) and jnp.issubdtype(dst, jnp.floating)):
        return Miss(f"scores converted from {src} to {dst}{where(node)}", node)
    return [Cast(node, node.ins[0], dst)]


@rule("transpose")
def _transpose(scope, node, out):
    return [Transpose(node, node.ins[0], tuple(node.params["permutation"]))]


@rule("copy", "copy_p")
def _copy(scope, node, out):
    return [Identity(node, node.ins[0])]


@rule("reshard")
def _reshard(scope, node, out):
    # Only a reshard that moves nothing is a copy; a real one changes where the
    # scores live, which the kernel call would lose.
    if not compat.same_layout(scope.aval(node.ins[0]), scope.aval(node.out)):
        return Miss(f"the scores are resharded{where(node)}", node)
    return [Identity(node, node.ins[0])]
