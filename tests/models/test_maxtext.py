"""MaxText's own ``AttentionOp`` (``attention_kernel="dot_product"``), the package
itself (tests/models/test_maxtext_style.py re-creates it by hand).

Skipped where MaxText is not installed: it is not in the test extras (it needs
Python 3.12 and JAX 0.11 or newer, and its dependencies are all optional extras:
flax, aqtp, tokamax, qwix, omegaconf, pydantic, pathwaysutils, jinja2).

Its training path merges the GQA ``(kv head, group)`` axes of the scores into
heads for an unnormalised ``exp``, splits the exponentials back for ``P·V`` and
divides the output by the row sums moved by a transpose; its masks are
``where(mask >= DEFAULT_MASK_VALUE * 0.5, logits, DEFAULT_MASK_VALUE)`` of an
additive mask built from segment ids and iotas (``deferred_regrouped`` in
tests/spellings.py is the same structure in plain JAX).  A tiny config from
MaxText's own base.yml, random weights, nothing downloaded.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

maxtext = pytest.importorskip("maxtext")
pytest.importorskip("maxtext.layers.attention_op")

from flax import nnx  # noqa: E402
from maxtext.common.common_types import AttentionType  # noqa: E402
from maxtext.configs import pyconfig  # noqa: E402
from maxtext.layers.attention_op import AttentionOp  # noqa: E402
from t_by_s import assert_no_t_by_s, jaxpr_shapes  # noqa: E402

import flashpass  # noqa: E402

from conftest import F32_TOL, assert_close, assert_tree_close  # noqa: E402

B, T, D_MODEL, HEADS, KV_HEADS, HEAD_DIM = 2, 32, 16, 4, 2, 8  # D_MODEL < T: x is no T x S array
WINDOW = 8
WHERE = "maxtext/layers/attention_op.py"


def _op(tmp_path, **kwargs):
    config = pyconfig.initialize(
        [""],
        run_name="flashpass",
        base_output_directory=str(tmp_path),
        enable_checkpointing=False,
        skip_jax_distributed_system=True,
        attention="dot_product",
        base_num_query_heads=HEADS,
        base_num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        max_target_length=T,
        per_device_batch_size=1,
        dtype="float32",
    )
    devices = np.asarray(jax.devices()[:1]).reshape([1] * len(config.mesh_axes))
    mesh = jax.sharding.Mesh(devices, config.mesh_axes)
    return AttentionOp(
        config=config,
        mesh=mesh,
        attention_kernel="dot_product",
        max_target_length=T,
        num_query_heads=HEADS,
        num_kv_heads=KV_HEADS,
        dtype=jnp.float32,
        rngs=nnx.Rngs(0),
        **kwargs,
    )


def _layer(op):
    """Projections around MaxText's op: ``fn(params, x, segment_ids)``; a
    ``"sinks"`` parameter (one logit per head) is passed as gpt-oss does."""

    def fn(params, x, segment_ids):
        q = jnp.einsum("btd,dnh->btnh", x, params["q"]) / np.sqrt(HEAD_DIM)
        k = jnp.einsum("btd,dnh->btnh", x, params["k"])
        v = jnp.einsum("btd,dnh->btnh", x, params["v"])
        positions = jnp.broadcast_to(jnp.arange(T), segment_ids.shape)
        out = op(q, k, v, segment_ids, positions, "train", sinks=params.get("sinks"))
        return jnp.einsum("btnh,nhd->btd", out, params["o"])

    return fn


def _inputs():
    rng = np.random.default_rng(0)

    def w(*shape):
        return jnp.asarray(rng.standard_normal(shape) / np.sqrt(shape[0]), jnp.float32)

    params = {
        "q": w(D_MODEL, HEADS, HEAD_DIM),
        "k": w(D_MODEL, KV_HEADS, HEAD_DIM),
        "v": w(D_MODEL, KV_HEADS, HEAD_DIM),
        "o": w(HEADS, HEAD_DIM, D_MODEL),
    }
    x = jnp.asarray(rng.standard_normal((B, T, D_MODEL)), jnp.float32)
    # packed documents: two in the first row, one in the second
    segment_ids = jnp.asarray([[1] * 20 + [2] * (T - 20), [1] * T], jnp.int32)
    return params, x, segment_ids


CASES = {
    "AttentionOp dot_product, GQA, packed segments, causal (Llama)": {},
    "AttentionOp dot_product, GQA, packed segments, soft-cap 50 (Gemma 2)": {
        "attn_logits_soft_cap": 50.0
    },
    "AttentionOp dot_product, GQA, packed segments, sliding window 8": {
        "attention_type": AttentionType.LOCAL_SLIDING,
        "sliding_window_size": WINDOW,
    },
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_maxtext_dot_product_attention(case, tmp_path, check_model):
    fn = _layer(_op(tmp_path, **CASES[case]))
    params, x, segment_ids = _inputs()
    report = check_model(
        fn, params, x, segment_ids, library="MaxText", case=case, sites=1, where=WHERE
    )
    assert "segments" in report.rewrites[0].mask, str(report)


def test_maxtext_attention_sinks(tmp_path, check_model):
    """gpt-oss: a learned sink logit per head joins each row's softmax."""
    params, x, segment_ids = _inputs()
    params["sinks"] = jnp.asarray(np.random.default_rng(1).standard_normal(HEADS), jnp.float32)
    case = "AttentionOp dot_product, GQA, packed segments, attention sinks (gpt-oss)"
    report = check_model(
        _layer(_op(tmp_path)), params, x, segment_ids,
        library="MaxText", case=case, sites=1, where=WHERE,
    )  # fmt: skip
    assert "sinks" in report.rewrites[0].mask, str(report)


def test_maxtext_training_step_keeps_no_t_by_s(tmp_path, record_coverage):
    """A whole training step optimized (the pass sees autodiff's backward): the
    site is rewritten forward and backward, first call under ``jax.jit``, the
    loss and gradients are the step's, and no array of its jaxpr holds T x S
    scores outside the kernel."""
    fn = _layer(_op(tmp_path, attn_logits_soft_cap=50.0))
    params, x, segment_ids = _inputs()
    step = jax.value_and_grad(lambda p, *a: jnp.sum(fn(p, *a) ** 2))
    opt = flashpass.optimize(step, kernel="blockwise")
    loss, grads = jax.jit(opt)(params, x, segment_ids)
    report = opt.reports[-1]
    case = "AttentionOp dot_product, soft-cap, value_and_grad train step, f32"
    record_coverage(report, library="MaxText", case=case, sites=1)
    assert len(report.rewrites) == 1 and not report.fallbacks, str(report)
    assert report.rewrites[0].backward, str(report)
    ref_loss, ref_grads = jax.jit(step)(params, x, segment_ids)
    assert_close(loss, ref_loss, F32_TOL, "loss")
    assert_tree_close(grads, ref_grads, F32_TOL, "grad")
    shapes = jaxpr_shapes(opt.rewritten_jaxpr(params, x, segment_ids), outside_kernels=True)
    control = jaxpr_shapes(jax.make_jaxpr(step)(params, x, segment_ids))
    assert_no_t_by_s(shapes, T, T, control=control)
