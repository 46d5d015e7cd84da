"""keras-hub backbones with the JAX backend, called statelessly
(``backbone.stateless_call``), so each forward pass is a pure JAX function.

Tiny configs (two layers where local and global layers alternate, else one),
random initial weights, nothing downloaded.  Sites: GPT-2, BERT and Bloom
spell attention out with einsums and Keras' masked ``Softmax`` (re-masking the
probabilities); Llama, Mistral, Qwen and Phi-3 call ``ops.dot_product_attention``;
Gemma 1/2/3 use grouped 5-D einsums, soft-caps (2) and sliding windows (2, 3)
whose mask is split into factors on the scores and applied whole to the
probabilities.  gpt-oss adds attention sinks (a concatenated logit column,
read as a `Sink` op) and a MoE router softmax that is not attention and must
never be rewritten.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

keras = pytest.importorskip("keras")
keras_hub = pytest.importorskip("keras_hub")
if keras.backend.backend() != "jax":  # pragma: no cover - conftest sets KERAS_BACKEND
    pytest.skip("keras is not using the JAX backend", allow_module_level=True)

import flashpass  # noqa: E402

B, T, VOCAB = 2, 12, 64
WHERE = "keras/src/"
GQA = dict(num_query_heads=4, num_key_value_heads=2, hidden_dim=16, intermediate_dim=32)


def _backbone(name: str, layers: int):
    m = keras_hub.models
    common = dict(vocabulary_size=VOCAB, num_layers=layers)
    gemma = dict(common, **GQA, head_dim=4)
    return {
        "gpt2": lambda: m.GPT2Backbone(
            **common, num_heads=2, hidden_dim=16, intermediate_dim=32, max_sequence_length=32
        ),
        "bert": lambda: m.BertBackbone(
            **common, num_heads=2, hidden_dim=16, intermediate_dim=32, max_sequence_length=32
        ),
        "bloom": lambda: m.BloomBackbone(**common, num_heads=2, hidden_dim=16, intermediate_dim=32),
        "llama": lambda: m.LlamaBackbone(**common, **GQA),
        "mistral": lambda: m.MistralBackbone(**common, **GQA, sliding_window=8),
        "qwen": lambda: m.QwenBackbone(**common, **GQA),
        "phi3": lambda: m.Phi3Backbone(**common, **GQA),
        "gemma": lambda: m.GemmaBackbone(**dict(gemma, num_key_value_heads=1)),
        "gemma2": lambda: m.GemmaBackbone(
            **gemma,
            query_head_dim_normalize=False,
            use_post_ffw_norm=True,
            use_post_attention_norm=True,
            final_logit_soft_cap=30.0,
            attention_logit_soft_cap=50.0,
            sliding_window_size=8,
            use_sliding_window_attention=True,
        ),
        "gemma3": lambda: m.Gemma3Backbone(
            **gemma,
            sliding_window_size=8,
            use_sliding_window_attention=True,
            global_layer_interval=2,
            image_size=896,
            vision_encoder=None,
        ),
        "gpt_oss": lambda: m.GptOssBackbone(
            **common, **dict(GQA, head_dim=4), num_experts=4, top_k=2
        ),
    }[name]()


def _inputs(name: str):
    # Row 1 is right-padded: a padding mask on every site.
    keep = np.arange(T)[None, :] < np.array([T, 9])[:, None]
    inputs = {"token_ids": jnp.asarray(np.arange(B * T).reshape(B, T) % VOCAB, jnp.int32)}
    inputs["padding_mask"] = jnp.asarray(keep)
    if name == "bert":
        inputs["segment_ids"] = jnp.zeros((B, T), jnp.int32)
    return inputs


def _forward(name: str, layers: int):
    backbone = _backbone(name, layers)
    rng = np.random.default_rng(0)
    params = [
        jnp.asarray(rng.standard_normal(v.shape) / np.sqrt(v.shape[0]), jnp.float32)
        if len(v.shape) >= 2
        else jnp.asarray(1.0 + 0.1 * rng.standard_normal(v.shape), jnp.float32)
        for v in backbone.trainable_variables
    ]
    state = [v.value for v in backbone.non_trainable_variables]

    def fn(params, inputs):
        out, _ = backbone.stateless_call(params, state, inputs, training=False)
        return out["sequence_output"] if isinstance(out, dict) else out

    return fn, params, _inputs(name)


# The default run covers each spelling once; the rest are slow variants.
_SLOW = pytest.mark.slow
CASES = [
    pytest.param("gpt2", "GPT-2 backbone", 1, id="gpt2", marks=_SLOW),
    pytest.param("bert", "BERT backbone", 1, id="bert", marks=_SLOW),
    pytest.param("bloom", "Bloom backbone (ALiBi)", 1, id="bloom"),
    pytest.param("llama", "Llama backbone (GQA)", 1, id="llama", marks=_SLOW),
    pytest.param("mistral", "Mistral backbone (GQA, sliding window)", 1, id="mistral", marks=_SLOW),
    pytest.param("qwen", "Qwen backbone (GQA)", 1, id="qwen", marks=_SLOW),
    pytest.param("phi3", "Phi-3 backbone (GQA)", 1, id="phi3", marks=_SLOW),
    pytest.param("gemma", "Gemma backbone (MQA)", 1, id="gemma", marks=_SLOW),
    pytest.param("gemma2", "Gemma 2 backbone (soft-cap, local + global)", 2, id="gemma2"),
    pytest.param("gemma3", "Gemma 3 backbone (local + global)", 2, id="gemma3", marks=_SLOW),
]


@pytest.mark.parametrize(("name", "case", "layers"), CASES)
def test_backbone(check_model, name, case, layers):
    fn, params, inputs = _forward(name, layers)
    check_model(fn, params, inputs, library="keras-hub", case=case, sites=layers, where=WHERE)


def test_gpt_oss_backbone(check_model):
    fn, params, inputs = _forward("gpt_oss", 1)
    check_model(
        fn,
        params,
        inputs,
        library="keras-hub",
        case="gpt-oss backbone (sinks, MoE)",
        sites=1,
        where=WHERE,  # (the MoE router's softmax over its top_k logits is no site)
    )


def test_gpt_oss_router_softmax_is_not_rewritten():
    # The MoE router's softmax over the top-k expert logits is not attention:
    # not rewritten and not reported as a kept site; the one rewrite is the
    # attention (with its sinks).
    fn, params, inputs = _forward("gpt_oss", 1)
    opt = flashpass.optimize(fn, kernel="blockwise")
    report = opt.explain(params, inputs)
    assert len(report.rewrites) == 1, str(report)
    ops = [op["op"] for op in report.rewrites[0].spec["score_ops"]]
    assert {"sink", "causal"} <= set(ops) and "sinks" in report.rewrites[0].mask, ops
    # keras-hub's merged causal & padding mask: causal as a descriptor, the
    # padding as an O(B*S) key mask, never a [B, 1, T, S] array.
    masks = [op["shape"] for op in report.rewrites[0].spec["score_ops"] if op["op"] == "mask"]
    assert all(shape[2] == 1 for shape in masks), masks
    assert not report.fallbacks and not report.unrecognised, str(report)
    np.testing.assert_allclose(
        np.asarray(opt(params, inputs)), np.asarray(fn(params, inputs)), rtol=1e-5, atol=1e-5
    )
