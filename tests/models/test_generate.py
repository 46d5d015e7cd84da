"""Generation loops rewritten whole (issue 41): keras-hub GPT-2 ``generate``
and Hugging Face Flax GPT-2 and Whisper ``generate``, tiny configs, random
weights, nothing downloaded.

Each library's generation function (its prefill, and a ``while_loop`` whose
body runs one cached decode step) is optimized whole, with the blockwise
kernel named (on CPU the cost model keeps such short caches as written).
Every attention site is rewritten — Keras' attention returns its weights and
the layer drops them, a dead use that must not block — and the token ids
equal the original's exactly (greedy decoding).
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashpass

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning"),
]

#: A softmax of the sampler's (over the vocabulary, into top-k): not attention.
SAMPLER = "feed `top_k`"


def _assert_every_site_rewritten(report, sites: int, not_attention=()):
    assert not report.errors, report
    assert len(report.rewrites) == sites, report
    for f in report.fallbacks:
        assert any(words in f.reason for words in not_attention), report


def test_keras_hub_gpt2_generate():
    keras = pytest.importorskip("keras")
    keras_hub = pytest.importorskip("keras_hub")
    if keras.backend.backend() != "jax":  # pragma: no cover - conftest sets KERAS_BACKEND
        pytest.skip("keras is not using the JAX backend")
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=64,
        num_layers=2,
        num_heads=2,
        hidden_dim=16,
        intermediate_dim=32,
        max_sequence_length=32,
    )
    lm = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None, sampler="greedy")

    def generate(state, inputs):  # keras-hub's own jax generate function, unjitted
        sampler, trainable, non_trainable = state
        mapping = itertools.chain(
            zip(lm.sampler.variables, sampler, strict=True),
            zip(lm.trainable_variables, trainable, strict=True),
            zip(lm.non_trainable_variables, non_trainable, strict=True),
        )
        with keras.StatelessScope(state_mapping=mapping):
            return lm.generate_step(inputs, None)["token_ids"]

    state = tuple(
        [v.value for v in vs]
        for vs in (lm.sampler.variables, lm.trainable_variables, lm.non_trainable_variables)
    )
    ids = np.zeros((2, 16), np.int32)
    ids[:, :5] = [[3, 4, 5, 6, 7], [9, 8, 7, 6, 5]]
    keep = np.zeros((2, 16), bool)
    keep[0, :5] = keep[1, :4] = True  # prompts of 5 and 4 tokens
    inputs = {"token_ids": jnp.asarray(ids), "padding_mask": jnp.asarray(keep)}
    opt = flashpass.optimize(generate, kernel="blockwise")
    # The prefill of layer 0 and the decode step of both layers (the prefill's
    # last layer feeds only logits generation does not read: dead code).
    _assert_every_site_rewritten(opt.explain(state, inputs), 3, (SAMPLER,))
    want = jax.jit(generate)(state, inputs)
    got = jax.jit(opt)(state, inputs)
    np.testing.assert_array_equal(got, want)
    assert not np.array_equal(want[:, 5:], 0)  # tokens were generated


def _hf(random_params, cls_name, config):
    tr = pytest.importorskip("transformers")
    pytest.importorskip("flax")
    if not hasattr(tr, cls_name):  # pragma: no cover - transformers >= 5
        pytest.skip("this transformers has no Flax models (need 4.57.x)")
    model = getattr(tr, cls_name)(config(tr), _do_init=False)
    init = functools.partial(model.init_weights, input_shape=model.input_shape)
    return model, random_params(init, jax.random.PRNGKey(0))


def test_hf_flax_gpt2_generate(random_params):
    model, params = _hf(
        random_params,
        "FlaxGPT2LMHeadModel",
        lambda tr: tr.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=64, vocab_size=128),
    )
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 128, (2, 6)), jnp.int32)

    def generate(params, ids):
        out = model.generate(ids, params=params, max_new_tokens=5, do_sample=False, pad_token_id=0)
        return out.sequences

    opt = flashpass.optimize(generate, kernel="blockwise")
    report = opt.explain(params, ids)
    _assert_every_site_rewritten(report, 4)  # prefill and decode step, two layers
    want = jax.jit(generate)(params, ids)
    np.testing.assert_array_equal(jax.jit(opt)(params, ids), want)


def test_hf_flax_whisper_generate(random_params):
    def config(tr):
        return tr.WhisperConfig(
            vocab_size=128,
            num_mel_bins=8,
            d_model=16,
            encoder_layers=1,
            decoder_layers=1,
            encoder_attention_heads=2,
            decoder_attention_heads=2,
            encoder_ffn_dim=32,
            decoder_ffn_dim=32,
            max_source_positions=16,
            max_target_positions=32,
            decoder_start_token_id=1,
            pad_token_id=0,
            eos_token_id=2,
            begin_suppress_tokens=None,
            suppress_tokens=None,
        )

    model, params = _hf(random_params, "FlaxWhisperForConditionalGeneration", config)
    features = jnp.asarray(np.random.default_rng(0).standard_normal((2, 8, 32)), jnp.float32)

    def generate(params, features):
        out = model.generate(features, params=params, max_new_tokens=4, do_sample=False)
        return out.sequences

    opt = flashpass.optimize(generate, kernel="blockwise")
    report = opt.explain(params, features)
    assert not report.errors and not report.fallbacks, report
    # Encoder self-attention; the decoder's self- and cross-attention, in the
    # prefill and in the loop's decode step.
    assert len(report.rewrites) >= 3, report
    want = jax.jit(generate)(params, features)
    np.testing.assert_array_equal(jax.jit(opt)(params, features), want)
