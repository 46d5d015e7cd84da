"""The optional tokamax adapter.

tokamax is never a dependency.  Without it the adapter rejects every site with
a reason; its argument mapping is checked against a stand-in module that
implements ``tokamax.dot_product_attention``'s documented semantics in plain
JAX; the real package is exercised (on a GPU) only when it is installed.
"""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_testing import BF16, F32, bias_op, has_gpu, mask_op, normal, run_and_compare, spec_of

from flashpass import compat
from flashpass.kernels import Causal, CheckContext, Mask, Scale, Softcap, get_kernel, kernel_names
from flashpass.kernels.tokamax import TokamaxKernel

KERNEL = get_kernel("tokamax")
GPU = CheckContext(platform="gpu")
INSTALLED = compat.tokamax_module() is not None


def test_registered_but_in_no_default_order():
    from flashpass.kernels import DEFAULT_ORDER

    assert "tokamax" in kernel_names() and isinstance(KERNEL, TokamaxKernel)
    assert all("tokamax" not in order for order in DEFAULT_ORDER.values())
    (reason,) = KERNEL.check(spec_of(dtype=BF16), CheckContext(platform="tpu"))
    assert "runs on gpu" in reason


@pytest.mark.skipif(INSTALLED, reason="tokamax is installed")
def test_not_installed_reason():
    (reason,) = KERNEL.check(spec_of(dtype=BF16, ops=[Scale(0.25)]), GPU)
    assert "'tokamax' package is not installed" in reason
    with pytest.raises(ValueError, match="not installed"):
        KERNEL.apply(spec_of(dtype=BF16), None, None, None)


def _stand_in_attention(
    q, k, v, bias=None, mask=None, *, scale, is_causal, logits_soft_cap, implementation
):
    """tokamax.dot_product_attention's documented semantics ([B, T, N, H] layout)."""
    assert implementation == ("mosaic", "triton")
    groups = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
    logits = scale * jnp.einsum("btnh,bsnh->bnts", q, k, preferred_element_type=jnp.float32)
    if bias is not None:
        logits = logits + bias
    if logits_soft_cap is not None:
        logits = logits_soft_cap * jnp.tanh(logits / logits_soft_cap)
    keep = jnp.ones(logits.shape, bool)
    if mask is not None:
        keep = keep & mask
    if is_causal:
        keep = keep & jnp.tril(jnp.ones(logits.shape[-2:], bool))
    logits = jnp.where(keep, logits, jnp.finfo(jnp.float32).min)
    p = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    return jnp.einsum("bnts,bsnh->btnh", p, v, preferred_element_type=jnp.float32).astype(q.dtype)


@pytest.fixture
def stand_in(monkeypatch):
    module = types.SimpleNamespace(dot_product_attention=_stand_in_attention)
    monkeypatch.setattr(compat, "tokamax_module", lambda: module)


@pytest.mark.parametrize("causal", [0, 9], ids=["top_left", "offset"])
def test_mapping_against_stand_in(stand_in, causal):
    """GQA, Dv != D, a bias before the soft-cap, a key mask with a fully masked
    example, causal (tokamax's own at offset 0 with T == S, else a mask)."""
    b, be = bias_op(0, (1, 4, 16, 16 + causal), BF16)
    m, me = mask_op(1, (2, 1, 1, 16 + causal))
    spec = spec_of(
        h=4,
        hkv=2,
        t=16,
        s=16 + causal,
        dv=8,
        dtype=BF16,
        ops=[Scale(0.3), b, Softcap(8.0), Mask(1, me.shape, -1e9), Causal(causal, -1e9)],
        extras=[be, me],
    )
    assert KERNEL.check(spec, GPU) == []
    keep = np.ones(me.shape, bool)
    keep[1] = False
    run_and_compare(KERNEL, spec, [normal(be.shape, 5, BF16), jnp.asarray(keep)], tol=3e-2)


def test_rejects_float32_and_late_bias(stand_in):
    (reason,) = KERNEL.check(spec_of(dtype=F32), GPU)
    assert "float32" in reason
    b, be = bias_op(0, (1, 2, 16, 16), BF16)
    late = spec_of(dtype=BF16, ops=[Softcap(8.0), b], extras=[be])
    assert any("after the logit soft-cap" in r for r in KERNEL.check(late, GPU))


@pytest.mark.skipif(not (INSTALLED and has_gpu()), reason="needs tokamax and a GPU")
def test_real_tokamax_on_gpu():
    spec = spec_of(h=4, hkv=2, t=256, d=64, dtype=BF16, ops=[Scale(0.125), Causal(0, -1e9)])
    assert KERNEL.check(spec, GPU) == []
    run_and_compare(KERNEL, spec, tol=3e-2, interpret=False)
