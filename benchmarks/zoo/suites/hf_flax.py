"""Hugging Face ``transformers`` 4.57 Flax models: every Flax class with softmax attention.

Tiny configs (hidden 32, 4 heads, 1-2 layers), random weights filled from
the parameter shapes (nothing runs an initialiser, nothing is downloaded),
sequences of 256 (encoder-decoders: 256 encoder / 128 decoder tokens;
vision: 256 patches + a class token; speech: 256 frames).  Text inputs carry
a padding mask with the second example right-padded.  Causal LMs are also
swept in greedy generation with the library's KV cache (``generate``).
RegNet and ResNet have no attention and are not listed.
"""

from __future__ import annotations

import functools
import os
import types

from ..model import Built, ZooModel

SUITE = "hf_flax"
B, T, T_DEC, VOCAB = 2, 256, 128, 128
GEN_PROMPT, GEN_NEW = 32, 8
H = dict(hidden_size=32, num_attention_heads=4, intermediate_size=64)
POS = dict(vocab_size=VOCAB, max_position_embeddings=1024)


def _tr():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import transformers

    _t5_clip_shim()
    return transformers


def _t5_clip_shim():
    """transformers 4.57's Flax T5 family calls ``jnp.clip(x, a_max=...)`` in its
    relative-position bucketing; JAX 0.10 removed ``a_min``/``a_max``.  Give
    those modules a ``jnp`` whose ``clip`` accepts the old names (the
    attention code is untouched; the model tests use the same shim)."""
    import importlib

    import jax.numpy as jnp

    class _Jnp(types.ModuleType):
        def __getattr__(self, name):
            return getattr(jnp, name)

        @staticmethod
        def clip(x, min=None, max=None, *, a_min=None, a_max=None):  # noqa: A002
            return jnp.clip(x, a_min if min is None else min, a_max if max is None else max)

    for name in ("t5", "mt5", "longt5"):
        module = importlib.import_module(f"transformers.models.{name}.modeling_flax_{name}")
        if not isinstance(module.jnp, _Jnp) and hasattr(module, "jnp"):
            module.jnp = _Jnp("jnp")


def _init(model, input_shape=None):
    import jax

    from ..weights import random_params

    shape = model.input_shape if input_shape is None else input_shape
    return random_params(
        functools.partial(model.init_weights, input_shape=shape), jax.random.PRNGKey(0)
    )


def _sq_loss(forward):
    import jax
    import jax.numpy as jnp

    def loss(params, *inputs):
        out = forward(params, *inputs)
        leaves = [
            x for x in jax.tree_util.tree_leaves(out) if jnp.issubdtype(x.dtype, jnp.floating)
        ]
        return sum(jnp.mean(jnp.square(x.astype(jnp.float32))) for x in leaves)

    return loss


def _first(out):
    return out[0]


# --------------------------------------------------------------------------- builders


def _decoder(cls_name, config, lm_cls=None, t=T):
    def build():
        from .. import weights as w

        tr = _tr()
        model = getattr(tr, cls_name)(config(tr), _do_init=False)
        params = _init(model, (1, 8))
        inputs = (w.ids((B, t), VOCAB), w.padding(B, t, t - 56))

        def forward(params, ids, mask):
            return model(ids, attention_mask=mask, params=params)[0]

        generate = gen_inputs = None
        if lm_cls is not None:
            lm = getattr(tr, lm_cls)(config(tr), _do_init=False)
            lm_params = _init(lm, (1, 8))

            def generate(params, prompt):
                return lm.generate(
                    prompt, params=params, max_new_tokens=GEN_NEW, do_sample=False, pad_token_id=0
                ).sequences

            gen_inputs = (w.ids((B, GEN_PROMPT), VOCAB, seed=3),)
            return Built(
                forward,
                params,
                inputs,
                loss=_sq_loss(forward),
                generate=lambda _p, prompt, lp=lm_params: generate(lp, prompt),
                generate_inputs=gen_inputs,
                seq=(t, t),
                notes=f"B={B}, padded row; generate: prompt {GEN_PROMPT} + {GEN_NEW} new tokens",
            )
        return Built(forward, params, inputs, loss=_sq_loss(forward), seq=(t, t), notes=f"B={B}")

    return build


def _encoder(cls_name, config, t=T):
    def build():
        from .. import weights as w

        tr = _tr()
        model = getattr(tr, cls_name)(config(tr), _do_init=False)
        params = _init(model, (1, t))
        inputs = (w.ids((B, t), VOCAB), w.padding(B, t, t - 56))

        def forward(params, ids, mask):
            return model(ids, attention_mask=mask, params=params)[0]

        return Built(forward, params, inputs, loss=_sq_loss(forward), seq=(t, t), notes=f"B={B}")

    return build


def _encoder_decoder(cls_name, config):
    def build():
        from .. import weights as w

        tr = _tr()
        model = getattr(tr, cls_name)(config(tr), _do_init=False)
        params = _init(model, (1, 8))
        inputs = (w.ids((B, T), VOCAB), w.padding(B, T, T - 56), w.ids((B, T_DEC), VOCAB, 1))

        def forward(params, ids, mask, dec_ids):
            out = model(ids, attention_mask=mask, decoder_input_ids=dec_ids, params=params)
            return out[0]

        return Built(
            forward,
            params,
            inputs,
            loss=_sq_loss(forward),
            seq=(T_DEC, T),
            notes=f"B={B}, encoder {T}, decoder {T_DEC}",
        )

    return build


def _vision(cls_name, config, image=64, channels=3, pooled=False):
    def build():
        from .. import weights as w

        tr = _tr()
        model = getattr(tr, cls_name)(config(tr), _do_init=False)
        params = _init(model)
        pixels = w.normal((B, channels, image, image))

        def forward(params, pixels):
            return model(pixels, params=params)[0]

        n = (image // 4) ** 2 + 1
        return Built(
            forward,
            (params),
            (pixels,),
            loss=_sq_loss(forward),
            seq=(n, n),
            notes=f"B={B}, {image}x{image} image, patch 4",
        )

    return build


def _clip():
    def build():
        from .. import weights as w

        tr = _tr()
        config = tr.CLIPConfig(
            text_config=dict(**H, num_hidden_layers=1, vocab_size=VOCAB, max_position_embeddings=T),
            vision_config=dict(**H, num_hidden_layers=1, image_size=64, patch_size=4),
            projection_dim=16,
        )
        model = tr.FlaxCLIPModel(config, _do_init=False)
        params = _init(model)
        inputs = (w.ids((B, T), VOCAB), w.normal((B, 3, 64, 64)), w.padding(B, T, T - 56))

        def forward(params, ids, pixels, mask):
            out = model(ids, pixels, attention_mask=mask, params=params)
            # The towers' hidden states: the projected embeddings are unit
            # vectors, whose squared norm (the loss) has no gradient to compare.
            return out.text_model_output[0], out.vision_model_output[0]

        return Built(
            forward, params, inputs, loss=_sq_loss(forward), seq=(T, T), notes="text + vision"
        )

    return build


def _wav2vec2():
    def build():
        from .. import weights as w

        tr = _tr()
        config = tr.Wav2Vec2Config(
            **H,
            num_hidden_layers=2,
            conv_dim=(16, 16),
            conv_stride=(4, 4),
            conv_kernel=(4, 4),
            num_conv_pos_embeddings=16,
            num_conv_pos_embedding_groups=4,
            do_stable_layer_norm=True,
            feat_extract_norm="layer",
            vocab_size=VOCAB,
        )
        model = tr.FlaxWav2Vec2Model(config, _do_init=False)
        params = _init(model, (1, 1024))
        audio = w.normal((B, 16 * T))
        mask = w.padding(B, 16 * T, 16 * (T - 56))

        def forward(params, audio, mask):
            return model(audio, attention_mask=mask, params=params)[0]

        return Built(
            forward,
            params,
            (audio, mask),
            loss=_sq_loss(forward),
            seq=(T, T),
            notes="16 kHz samples, 256 frames",
        )

    return build


def _whisper():
    def build():
        from .. import weights as w

        tr = _tr()
        config = tr.WhisperConfig(
            vocab_size=VOCAB,
            num_mel_bins=16,
            d_model=32,
            encoder_layers=1,
            decoder_layers=1,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=64,
            decoder_ffn_dim=64,
            max_source_positions=T,
            max_target_positions=T_DEC,
        )
        model = tr.FlaxWhisperModel(config, _do_init=False)
        params = _init(model, (1, 16, 2 * T))
        feats = w.normal((B, 16, 2 * T))
        dec = w.ids((B, T_DEC), VOCAB, 1)

        def forward(params, feats, dec):
            return model(feats, decoder_input_ids=dec, params=params)[0]

        return Built(
            forward,
            params,
            (feats, dec),
            loss=_sq_loss(forward),
            seq=(T_DEC, T),
            notes="16 mel bins, 512 frames",
        )

    return build


# --------------------------------------------------------------------------- configs

_DEC = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, **POS)


def _gpt2(tr):
    return tr.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=1024, vocab_size=VOCAB)


def _gpt_neo(tr):
    return tr.GPTNeoConfig(
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        attention_types=[[["global", "local"], 1]],
        window_size=64,
        **POS,
    )


def _gptj(tr):
    return tr.GPTJConfig(
        n_embd=32, n_layer=2, n_head=4, n_positions=1024, rotary_dim=4, vocab_size=VOCAB
    )


def _opt(tr):
    return tr.OPTConfig(
        hidden_size=32,
        ffn_dim=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        word_embed_proj_dim=32,
        **POS,
    )


def _llama(tr):
    return tr.LlamaConfig(**_DEC, num_key_value_heads=2)


def _mistral(tr):
    return tr.MistralConfig(**_DEC, num_key_value_heads=2, sliding_window=64)


def _gemma(tr):
    return tr.GemmaConfig(**_DEC, num_key_value_heads=1, head_dim=8)


def _bloom(tr):
    return tr.BloomConfig(hidden_size=32, n_layer=2, n_head=4, vocab_size=VOCAB)


def _xglm(tr):
    return tr.XGLMConfig(
        d_model=32,
        num_layers=2,
        attention_heads=4,
        ffn_dim=64,
        vocab_size=VOCAB,
        max_position_embeddings=1024,
    )


_ENC = dict(**H, num_hidden_layers=2, **POS)


def _enc(config_name, **extra):
    return lambda tr: getattr(tr, config_name)(**_ENC, **extra)


def _distilbert(tr):
    return tr.DistilBertConfig(dim=32, n_layers=2, n_heads=4, hidden_dim=64, **POS)


def _albert(tr):
    return tr.AlbertConfig(embedding_size=16, **_ENC)


def _big_bird(tr):
    return tr.BigBirdConfig(
        **_ENC, attention_type="block_sparse", block_size=16, num_random_blocks=2
    )


def _big_bird_full(tr):
    return tr.BigBirdConfig(**_ENC, attention_type="original_full")


_S2S = dict(
    d_model=32,
    encoder_layers=1,
    decoder_layers=1,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=64,
    decoder_ffn_dim=64,
    **POS,
)


def _s2s(config_name, **extra):
    return lambda tr: getattr(tr, config_name)(**_S2S, **extra)


def _t5(config_name, **extra):
    return lambda tr: getattr(tr, config_name)(
        vocab_size=VOCAB,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=1,
        num_decoder_layers=1,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=64,
        decoder_start_token_id=0,
        **extra,
    )


_VIT = dict(**H, num_hidden_layers=2, image_size=64, patch_size=4, num_channels=3)


def _vit(config_name, **extra):
    return lambda tr: getattr(tr, config_name)(**_VIT, **extra)


def _m(name, family, build, sample=False, modes=("direct", "jit", "train", "export"), **kw):
    return ZooModel(SUITE, name, family, build, modes=modes, sample=sample, **kw)


_LM = ("direct", "jit", "train", "generate", "export")

MODELS = [
    # decoder-only LMs (greedy generation with the library's KV cache)
    _m("GPT-2", "decoder", _decoder("FlaxGPT2Model", _gpt2, "FlaxGPT2LMHeadModel"), True, _LM),
    _m(
        "GPT-Neo",
        "decoder",
        _decoder("FlaxGPTNeoModel", _gpt_neo, "FlaxGPTNeoForCausalLM"),
        modes=_LM,
    ),
    _m("GPT-J", "decoder", _decoder("FlaxGPTJModel", _gptj, "FlaxGPTJForCausalLM"), modes=_LM),
    _m("OPT", "decoder", _decoder("FlaxOPTModel", _opt, "FlaxOPTForCausalLM"), modes=_LM),
    _m("Llama", "decoder", _decoder("FlaxLlamaModel", _llama, "FlaxLlamaForCausalLM"), modes=_LM),
    _m(
        "Mistral",
        "decoder",
        _decoder("FlaxMistralModel", _mistral, "FlaxMistralForCausalLM"),
        modes=_LM,
    ),
    _m("Gemma", "decoder", _decoder("FlaxGemmaModel", _gemma, "FlaxGemmaForCausalLM"), modes=_LM),
    _m("BLOOM", "decoder", _decoder("FlaxBloomModel", _bloom, "FlaxBloomForCausalLM"), modes=_LM),
    _m("XGLM", "decoder", _decoder("FlaxXGLMModel", _xglm, "FlaxXGLMForCausalLM"), modes=_LM),
    # encoders
    _m("BERT", "encoder", _encoder("FlaxBertModel", _enc("BertConfig")), True),
    _m("RoBERTa", "encoder", _encoder("FlaxRobertaModel", _enc("RobertaConfig"))),
    _m(
        "RoBERTa-PreLayerNorm",
        "encoder",
        _encoder("FlaxRobertaPreLayerNormModel", _enc("RobertaPreLayerNormConfig")),
    ),
    _m("XLM-RoBERTa", "encoder", _encoder("FlaxXLMRobertaModel", _enc("XLMRobertaConfig"))),
    _m(
        "ELECTRA", "encoder", _encoder("FlaxElectraModel", _enc("ElectraConfig", embedding_size=16))
    ),
    _m("DistilBERT", "encoder", _encoder("FlaxDistilBertModel", _distilbert)),
    _m("ALBERT", "encoder", _encoder("FlaxAlbertModel", _albert)),
    _m("RoFormer", "encoder", _encoder("FlaxRoFormerModel", _enc("RoFormerConfig"))),
    _m("BigBird (full)", "encoder", _encoder("FlaxBigBirdModel", _big_bird_full)),
    _m("BigBird (block sparse)", "encoder", _encoder("FlaxBigBirdModel", _big_bird)),
    # encoder-decoders
    _m("BART", "encoder-decoder", _encoder_decoder("FlaxBartModel", _s2s("BartConfig")), True),
    _m("mBART", "encoder-decoder", _encoder_decoder("FlaxMBartModel", _s2s("MBartConfig"))),
    _m("Pegasus", "encoder-decoder", _encoder_decoder("FlaxPegasusModel", _s2s("PegasusConfig"))),
    _m(
        "Blenderbot",
        "encoder-decoder",
        _encoder_decoder("FlaxBlenderbotModel", _s2s("BlenderbotConfig")),
    ),
    _m(
        "Blenderbot-small",
        "encoder-decoder",
        _encoder_decoder("FlaxBlenderbotSmallModel", _s2s("BlenderbotSmallConfig")),
    ),
    _m(
        "Marian",
        "encoder-decoder",
        _encoder_decoder(
            "FlaxMarianModel", _s2s("MarianConfig", pad_token_id=0, decoder_start_token_id=0)
        ),
    ),
    _m("T5", "encoder-decoder", _encoder_decoder("FlaxT5Model", _t5("T5Config"))),
    _m("mT5", "encoder-decoder", _encoder_decoder("FlaxMT5Model", _t5("MT5Config"))),
    _m(
        "LongT5 (local)",
        "encoder-decoder",
        _encoder_decoder(
            "FlaxLongT5Model", _t5("LongT5Config", encoder_attention_type="local", local_radius=32)
        ),
    ),
    _m(
        "LongT5 (transient-global)",
        "encoder-decoder",
        _encoder_decoder(
            "FlaxLongT5Model",
            _t5(
                "LongT5Config",
                encoder_attention_type="transient-global",
                local_radius=32,
                global_block_size=16,
            ),
        ),
    ),
    # vision
    _m("ViT", "vision", _vision("FlaxViTModel", _vit("ViTConfig")), True),
    _m(
        "BEiT",
        "vision",
        _vision("FlaxBeitModel", _vit("BeitConfig", use_relative_position_bias=True)),
    ),
    _m("DINOv2", "vision", _vision("FlaxDinov2Model", _vit("Dinov2Config"))),
    _m("CLIP", "vision", _clip()),
    # speech
    _m("Wav2Vec2", "speech", _wav2vec2()),
    _m("Whisper", "speech", _whisper(), True),
]

# Long sequences with the platform's default kernel order (no kernel named):
# the CPU cost model decides which sites are worth a kernel.
LONG = 1024
MODELS += [
    _m(
        f"GPT-2 (T={LONG}, default kernels)",
        "decoder",
        _decoder("FlaxGPT2Model", _gpt2, t=LONG),
        kernel=None,
        modes=("direct", "train"),
    ),
    _m(
        f"BERT (T={LONG}, default kernels)",
        "encoder",
        _encoder("FlaxBertModel", _enc("BertConfig"), t=LONG),
        kernel=None,
        modes=("direct", "train"),
    ),
]
