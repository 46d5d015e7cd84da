"""penzai's transformer variants (``penzai.models.transformer.variants``):
llama-like, Gemma-like (Gemma 2: alternating sliding-window and global layers,
attention-logit soft-cap, post-norms, final-logit soft-cap) and GPT-NeoX-like,
random init from tiny configs, their parameters unbound and passed in as frozen
values so the forward pass is a pure function of them.

Penzai's named-axis arrays copy the probabilities before ``P·V`` (a ``copy``
equation), and its grouped-query heads are a 5-D einsum.  Under a layer stack
(``use_layer_stack=True``) the masked-out fill is a per-layer value sliced by
the ``scan``: a slice of a uniform stacked operand is the same scalar fill.
Penzai's Gemma builder loads checkpoints only (``gemma_from_pretrained_checkpoint``),
so the Gemma-like model is built, as that function does, from a
``LlamalikeTransformerConfig`` with Gemma 2's settings; its layer stack takes one
attention type for every layer (penzai raises on per-layer types).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

pz = pytest.importorskip("penzai.pz")
llamalike_common = pytest.importorskip("penzai.models.transformer.variants.llamalike_common")
gpt_neox = pytest.importorskip("penzai.models.transformer.variants.gpt_neox")

WHERE = "penzai/"
VOCAB = 32
#: Penzai's fill for masked-out logits (the value Gemma's reference uses).
FILL = -2.3819763e38


def _pure(model):
    """``fn(params, tokens)`` running ``model`` with its parameters passed in."""
    unbound, params = pz.unbind_params(model)
    tokens = pz.nx.wrap(jnp.arange(16, dtype=jnp.int32).reshape(2, 8) % VOCAB).tag("batch", "seq")

    def fn(params, tokens):
        out = pz.bind_variables(unbound, params)(tokens)
        return out.unwrap("batch", "seq", "vocabulary")

    return fn, [p.freeze() for p in params], tokens


def _llamalike(layer_stack: bool, **overrides):
    cfg = dict(
        num_kv_heads=2,
        query_head_multiplier=2,
        embedding_dim=16,
        projection_dim=4,
        mlp_hidden_dim=32,
        num_decoder_blocks=2,
        vocab_size=VOCAB,
        mlp_variant="geglu_approx",
        tie_embedder_and_logits=False,
        rope_wavelength=10_000,
        use_layer_stack=layer_stack,
    )
    cfg = llamalike_common.LlamalikeTransformerConfig(**{**cfg, **overrides})
    return _pure(llamalike_common.build_llamalike_transformer(cfg, init_base_rng=jax.random.key(0)))


def _gemma2(layer_stack: bool):
    window = llamalike_common.AttentionTypeSlidingWindowCausal(4)  # 8 tokens: it excludes keys
    return _llamalike(
        layer_stack,
        attention_type=window
        if layer_stack
        else (window, llamalike_common.AttentionTypeGlobalCausal()),
        tie_embedder_and_logits=True,
        use_post_attn_norm=True,
        use_post_ffw_norm=True,
        final_logit_softcap=30.0,
        attn_logits_soft_cap=50.0,
    )


def _gpt_neox(layer_stack: bool):
    cfg = gpt_neox.GPTNeoXTransformerConfig(
        num_attention_heads=2,
        embedding_dim=16,
        projection_dim=8,
        mlp_hidden_dim=32,
        num_decoder_blocks=2,
        vocab_size=VOCAB,
        activation_fn="gelu_exact",
        rope_subset_size=4,  # partial rotary, as in GPT-NeoX
        rope_wavelength=10_000,
        layernorm_epsilon=1e-5,
        parameter_dtype=jnp.float32,
        activation_dtype=jnp.float32,
        use_layer_stack=layer_stack,
    )
    return _pure(gpt_neox.build_gpt_neox_transformer(cfg, init_base_rng=jax.random.key(0)))


def _score_ops(report):
    """Per rewrite, its score ops without their fills: ``[("softcap", 50.0), ...]``."""
    out = []
    for r in report.rewrites:
        ops = []
        for op in r.spec["score_ops"]:
            assert op.get("fill", FILL) == pytest.approx(FILL, rel=1e-6), op
            ops.append(tuple(v for k, v in op.items() if k != "fill"))
        out.append(ops)
    return out


def test_llamalike(check_model):
    fn, params, tokens = _llamalike(layer_stack=False)
    check_model(
        fn,
        params,
        tokens,
        library="penzai",
        case="llamalike (GQA, 2 blocks)",
        sites=2,
        where=WHERE,
    )


@pytest.mark.slow
def test_llamalike_layer_stack(check_model):
    # The layer stack's per-layer masked_out_value is sliced by the scan: a slice of a
    # uniform stacked operand is the same scalar fill (`Scope.sliced`).
    fn, params, tokens = _llamalike(layer_stack=True)
    check_model(
        fn, params, tokens, library="penzai", case="llamalike layer stack", sites=1, where=WHERE
    )


def test_gemma2_like(check_model):
    fn, params, tokens = _gemma2(layer_stack=False)
    report = check_model(
        fn,
        params,
        tokens,
        library="penzai",
        case="Gemma 2-like (GQA, sliding window + global, soft-cap 50)",
        sites=2,
        where=WHERE,
    )
    # Layer 0 is the sliding window (4 keys: j in [i-3, i]), layer 1 global causal;
    # both soft-capped before the mask.
    assert _score_ops(report) == [
        [("softcap", 50.0), ("window", 3, 0)],
        [("softcap", 50.0), ("causal", 0)],
    ]
    assert [r.mask for r in report.rewrites] == ["window", "causal"]
    assert all(r.q_shape == (2, 8, 2, 2, 4) for r in report.rewrites)  # grouped 5-D q


@pytest.mark.slow
def test_gemma2_like_layer_stack(check_model):
    fn, params, tokens = _gemma2(layer_stack=True)
    report = check_model(
        fn,
        params,
        tokens,
        library="penzai",
        case="Gemma 2-like layer stack (sliding window, soft-cap)",
        sites=1,
        where=WHERE,
        scope="scan",
    )
    assert _score_ops(report) == [[("softcap", 50.0), ("window", 3, 0)]]


@pytest.mark.slow  # (the default set has penzai's llama- and gemma2-like models)
def test_gpt_neox_like(check_model):
    fn, params, tokens = _gpt_neox(layer_stack=False)
    report = check_model(
        fn,
        params,
        tokens,
        library="penzai",
        case="GPT-NeoX-like (partial RoPE, 2 blocks)",
        sites=2,
        where=WHERE,
    )
    assert _score_ops(report) == [[("causal", 0)], [("causal", 0)]]


@pytest.mark.slow
def test_gpt_neox_like_layer_stack(check_model):
    fn, params, tokens = _gpt_neox(layer_stack=True)
    report = check_model(
        fn,
        params,
        tokens,
        library="penzai",
        case="GPT-NeoX-like layer stack",
        sites=1,
        where=WHERE,
        scope="scan",
    )
    assert _score_ops(report) == [[("causal", 0)]]
