"""Hugging Face ``transformers`` Flax models (4.57.x, the last line with Flax
classes), built from tiny configs with random weights: never downloaded (the
conftest sets HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE)."""

from __future__ import annotations

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

tr = pytest.importorskip("transformers")
pytest.importorskip("flax")
if not hasattr(tr, "FlaxGPT2Model"):  # pragma: no cover - transformers >= 5
    pytest.skip("this transformers has no Flax models (need 4.57.x)", allow_module_level=True)

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

B, T, T_DEC, VOCAB = 2, 16, 8, 128
STACK_TOL = 5e-5  # two layers deep (measured error: at most 3e-6)
SMALL = dict(vocab_size=VOCAB, max_position_embeddings=64)


def _ids(seed=0, length=T):
    return jnp.asarray(np.random.default_rng(seed).integers(0, VOCAB, (B, length)), jnp.int32)


def _padding(length=T):
    """Second example padded: [[1]*length, [1]*10 + [0]*(length-10)]."""
    return jnp.asarray(np.arange(length)[None, :] < np.array([length, 10])[:, None], jnp.int32)


def _where(model_dir):
    return f"transformers/models/{model_dir}/modeling_flax_{model_dir}.py"


def _build(cls, config, random_params):
    model = cls(config, _do_init=False)
    init = functools.partial(model.init_weights, input_shape=model.input_shape)
    return model, random_params(init, jax.random.PRNGKey(0))


# --------------------------------------------------------------------------- decoder-only LMs


DECODERS = {
    # name: (model dir, class, config, layers)
    "GPT-2": (
        "gpt2",
        "FlaxGPT2Model",
        lambda: tr.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=64, vocab_size=VOCAB),
    ),
    "Llama (GQA: 2 kv heads / 4)": (
        "llama",
        "FlaxLlamaModel",
        lambda: tr.LlamaConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            **SMALL,
        ),
    ),
    "GPT-Neo (global + local layer)": (
        "gpt_neo",
        "FlaxGPTNeoModel",
        lambda: tr.GPTNeoConfig(
            hidden_size=32,
            num_layers=2,
            num_heads=4,
            attention_types=[[["global", "local"], 1]],
            window_size=8,
            **SMALL,
        ),
    ),
    "Mistral (GQA, sliding window 8)": (
        "mistral",
        "FlaxMistralModel",
        lambda: tr.MistralConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            sliding_window=8,
            **SMALL,
        ),
    ),
    "Gemma (MQA)": (
        "gemma",
        "FlaxGemmaModel",
        lambda: tr.GemmaConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=8,
            **SMALL,
        ),
    ),
    "OPT": (
        "opt",
        "FlaxOPTModel",
        lambda: tr.OPTConfig(
            hidden_size=32,
            ffn_dim=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            word_embed_proj_dim=32,
            **SMALL,
        ),
    ),
    "BLOOM (ALiBi)": (
        "bloom",
        "FlaxBloomModel",
        lambda: tr.BloomConfig(hidden_size=32, n_layer=2, n_head=4, vocab_size=VOCAB),
    ),
}
LAYERS = 2


@pytest.mark.parametrize("padded", [False, True], ids=["no mask", "padding mask"])
@pytest.mark.parametrize("name", list(DECODERS))
def test_decoder(check_model, random_params, name, padded):
    model_dir, cls_name, config = DECODERS[name]
    model, params = _build(getattr(tr, cls_name), config(), random_params)
    inputs = (_ids(), _padding()) if padded else (_ids(),)

    def fn(params, ids, *mask):
        return model(ids, attention_mask=mask[0] if mask else None, params=params)[0]

    check_model(
        fn,
        params,
        *inputs,
        library="transformers",
        case=f"{name}, {'padding mask' if padded else 'no mask'}",
        sites=LAYERS,
        where=_where(model_dir),
        tol=STACK_TOL,
    )


def test_llama_kv_cache_decode_step(check_model, random_params):
    """Generation: one token against a KV cache filled by a 16-token prefill
    (single query, 32 cache slots, mask from the cache index)."""
    _, _, config = DECODERS["Llama (GQA: 2 kv heads / 4)"]
    model, params = _build(tr.FlaxLlamaForCausalLM, config(), random_params)
    slots = 2 * T
    mask = jnp.ones((B, slots), jnp.int32)

    def run(params, ids, cache, start):
        pos = start + jnp.broadcast_to(jnp.arange(ids.shape[1])[None], ids.shape)
        return model(
            ids, attention_mask=mask, position_ids=pos, params=params, past_key_values=cache
        )

    cache = run(params, _ids(), model.init_cache(B, slots), 0).past_key_values
    check_model(
        lambda params, token, cache: run(params, token, cache, T).logits,
        params,
        _ids(2, 1),
        cache,
        library="transformers",
        case="Llama (GQA), KV-cache decode step (1 query, 32 slots)",
        sites=LAYERS,
        where=_where("llama"),
        tol=STACK_TOL,
    )


# --------------------------------------------------------------------------- encoders


def test_bert_padding(check_model, random_params):
    config = tr.BertConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, **SMALL
    )
    model, params = _build(tr.FlaxBertModel, config, random_params)
    check_model(
        lambda params, ids, mask: model(ids, attention_mask=mask, params=params)[0],
        params,
        _ids(),
        _padding(),
        library="transformers",
        case="BERT, padding mask",
        sites=2,
        where=_where("bert"),
        tol=STACK_TOL,
    )


def test_vit(check_model, random_params):
    config = tr.ViTConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        image_size=16,
        patch_size=4,
        num_channels=3,
    )
    model, params = _build(tr.FlaxViTModel, config, random_params)
    pixels = jnp.asarray(np.random.default_rng(0).standard_normal((B, 3, 16, 16)), jnp.float32)
    check_model(
        lambda params, pixels: model(pixels, params=params)[0],
        params,
        pixels,
        library="transformers",
        case="ViT (16 patches + CLS)",
        sites=2,
        where=_where("vit"),
        tol=STACK_TOL,
    )


# --------------------------------------------------------------------------- encoder-decoders


@pytest.fixture
def t5_clip_shim(monkeypatch):
    """transformers 4.57's Flax T5 calls ``jnp.clip(x, a_max=...)`` in its
    relative-position bucketing; JAX 0.10 removed ``a_min``/``a_max``.  Give the
    T5 module a ``jnp`` whose ``clip`` accepts the old names (the attention
    code is untouched)."""
    from transformers.models.t5 import modeling_flax_t5

    class _Jnp(types.ModuleType):
        def __getattr__(self, name):
            return getattr(jnp, name)

        @staticmethod
        def clip(x, min=None, max=None, *, a_min=None, a_max=None):  # noqa: A002
            return jnp.clip(x, a_min if min is None else min, a_max if max is None else max)

    monkeypatch.setattr(modeling_flax_t5, "jnp", _Jnp("jnp"))


def _encoder_decoder(check_model, model, params, *, case, model_dir):
    def fn(params, ids, mask, dec_ids):
        return model(ids, attention_mask=mask, decoder_input_ids=dec_ids, params=params)[0]

    # 1 encoder layer (self) + 1 decoder layer (causal self + cross): 3 sites
    return check_model(
        fn,
        params,
        _ids(),
        _padding(),
        _ids(1, T_DEC),
        library="transformers",
        case=case,
        sites=3,
        where=_where(model_dir),
        tol=STACK_TOL,
    )


def test_t5(check_model, random_params, t5_clip_shim):
    config = tr.T5Config(
        vocab_size=VOCAB,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=1,
        num_decoder_layers=1,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
        decoder_start_token_id=0,
    )
    model, params = _build(tr.FlaxT5Model, config, random_params)
    _encoder_decoder(
        check_model,
        model,
        params,
        case="T5 (relative bias, no scaling, cross-attention), padding mask",
        model_dir="t5",
    )


def test_bart(check_model, random_params):
    config = tr.BartConfig(
        d_model=32,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        **SMALL,
    )
    model, params = _build(tr.FlaxBartModel, config, random_params)
    _encoder_decoder(
        check_model,
        model,
        params,
        case="BART (q pre-scaled, cross-attention), padding mask",
        model_dir="bart",
    )


# --------------------------------------------------------------------------- long padded batches

LONG = 256
PADDED = {
    # name: (model class, config, score ops expected)
    "GPT-2": (
        "FlaxGPT2Model",
        lambda: tr.GPT2Config(
            n_embd=32, n_layer=2, n_head=4, n_positions=2 * LONG, vocab_size=VOCAB
        ),
        ["causal", "emptyrows", "mask"],
    ),
    "Llama (GQA)": (
        "FlaxLlamaModel",
        lambda: tr.LlamaConfig(
            hidden_size=32,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=8,
            num_hidden_layers=2,
            vocab_size=VOCAB,
            max_position_embeddings=2 * LONG,
        ),
        ["causal", "emptyrows", "mask"],
    ),
    "BERT": (
        "FlaxBertModel",
        lambda: tr.BertConfig(
            hidden_size=32,
            num_attention_heads=4,
            num_hidden_layers=2,
            intermediate_size=64,
            vocab_size=VOCAB,
            max_position_embeddings=2 * LONG,
        ),
        ["emptyrows", "mask"],
    ),
}


@pytest.mark.parametrize(
    "name",
    [n if "Llama" in n else pytest.param(n, marks=pytest.mark.slow) for n in PADDED],
)
def test_padding_mask_reaches_the_kernel_as_o_of_s(random_params, name):
    """A left-padded batch (#28): the model's additive ``lax.select(mask > 0,
    0, finfo.min)`` bias over causality and ``attention_mask`` reaches the
    kernel as causal + a ``[B,1,1,S]`` key mask + `EmptyRows` (the padded
    example's first rows keep no key), with no ``T x S`` kernel operand, in a
    forward and a training step's gradient, equal to the original's."""
    from t_by_s import kernel_operand_shapes

    import flashpass

    cls_name, config, want = PADDED[name]
    model, params = _build(getattr(tr, cls_name), config(), random_params)
    ids = _ids(length=LONG)
    mask = np.ones((B, LONG), np.int32)
    mask[1, :40] = 0  # left padding
    mask = jnp.asarray(mask)

    def loss(params, ids, mask):
        out = model(ids, attention_mask=mask, params=params)[0]
        return jnp.mean(jnp.square(out) * mask[..., None])

    grad = jax.value_and_grad(loss)
    opt = flashpass.optimize(grad, kernel="blockwise")
    (got, got_g), (want_v, want_g) = (
        jax.jit(opt)(params, ids, mask),
        jax.jit(grad)(params, ids, mask),
    )
    np.testing.assert_allclose(got, want_v, rtol=1e-5)
    for a, b in zip(
        jax.tree_util.tree_leaves(got_g), jax.tree_util.tree_leaves(want_g), strict=True
    ):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=2e-6)
    report = opt.explain(params, ids, mask)
    assert len(report.rewrites) == LAYERS and not report.fallbacks, str(report)
    for r in report.rewrites:
        assert r.backward and not r.dense, str(report)
        assert sorted(op["op"] for op in r.spec["score_ops"] if op["op"] != "scale") == want
    shapes = kernel_operand_shapes(opt.rewritten_jaxpr(params, ids, mask))
    assert not [s for s in shapes if sum(d >= LONG for d in s) >= 2], shapes
