"""keras-hub 0.32 backbones with attention, on the JAX backend, through ``stateless_call``.

Each backbone is built from a tiny config (hidden 16-32, 1-2 layers) with
random weights; its inputs come from the backbone's own functional inputs
(token ids with the second example right-padded, images, audio features),
with sequences of 256 (vision: 256 patches).  The forward is
``backbone.stateless_call(trainable, non_trainable, inputs)``, a pure JAX
function of the trainable weights.  Backbones without attention (ResNet,
EfficientNet, FNet, RWKV, ...) are not listed.
"""

from __future__ import annotations

from ..model import Built, ZooModel

SUITE = "keras_hub"
B, T, VOCAB = 2, 256, 64
IMAGE = 64
TXT = dict(vocabulary_size=VOCAB, num_layers=2, hidden_dim=32, intermediate_dim=64)
MHA = dict(TXT, num_heads=4)
GQA = dict(TXT, num_query_heads=4, num_key_value_heads=2)


def _keras_hub():
    import os

    os.environ.setdefault("KERAS_BACKEND", "jax")
    import keras
    import keras_hub

    if keras.backend.backend() != "jax":
        raise RuntimeError("keras is not using the JAX backend (set KERAS_BACKEND=jax)")
    return keras_hub


def _value(name: str, shape, dtype: str, t: int, seed: int):
    """A value for one functional input of a backbone: token ids, a padding
    mask (second example right-padded), segment ids, or normal floats."""
    import jax.numpy as jnp
    import numpy as np

    from .. import weights as w

    shape = tuple(
        B if i == 0 and d is None else (t if d is None else d) for i, d in enumerate(shape)
    )
    if "mask" in name:
        keep = w.padding(shape[0], shape[1], shape[1] - 56) if len(shape) == 2 else None
        return jnp.asarray(keep, jnp.bool_ if dtype == "bool" else dtype)
    if "segment" in name:
        return jnp.zeros(shape, dtype)
    if "int" in dtype:
        return w.ids(shape, VOCAB, seed)
    if dtype == "bool":
        return jnp.ones(shape, bool)
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def _first_float(out):
    import jax
    import jax.numpy as jnp

    if isinstance(out, dict):  # the sequence (or encoder-decoder) outputs, in a fixed order
        return tuple(
            out[k] for k in sorted(out) if jnp.issubdtype(jnp.result_type(out[k]), jnp.floating)
        )
    return tuple(x for x in jax.tree_util.tree_leaves(out) if jnp.issubdtype(x.dtype, jnp.floating))


def _backbone(factory, t=T, seq=None, inputs=None, notes=""):
    """A `Built` of the backbone ``factory(keras_hub.models)`` returns."""

    def build():
        import jax
        import jax.numpy as jnp
        import numpy as np

        kh = _keras_hub()
        backbone = factory(kh.models)
        rng = np.random.default_rng(0)
        params = [
            jnp.asarray(rng.standard_normal(v.shape) / np.sqrt(v.shape[0]), "float32")
            if len(v.shape) >= 2
            else jnp.asarray(1.0 + 0.1 * rng.standard_normal(v.shape), "float32")
            for v in backbone.trainable_variables
        ]
        state = [v.value for v in backbone.non_trainable_variables]
        specs = backbone.input if isinstance(backbone.input, dict) else {"x": backbone.input}
        values = {}
        overrides = inputs() if callable(inputs) else inputs
        for i, (name, spec) in enumerate(sorted(specs.items())):
            if overrides and name in overrides:
                values[name] = overrides[name]()
            else:
                values[name] = _value(name, spec.shape, spec.dtype, t, i)
        if not isinstance(backbone.input, dict):
            values = values["x"]

        def forward(params, x):
            out, _ = backbone.stateless_call(params, state, x, training=False)
            return _first_float(out)

        def loss(params, x):
            return sum(jnp.mean(jnp.square(y.astype(jnp.float32))) for y in forward(params, x))

        jax.eval_shape(forward, params, values)  # fail at build time on bad inputs
        return Built(
            forward, params, (values,), loss=loss, seq=seq or (t, t), notes=notes or f"B={B}"
        )

    return build


def _m(name, family, build, sample=False, modes=("direct", "jit", "train", "export"), **kw):
    return ZooModel(SUITE, name, family, build, modes=modes, sample=sample, **kw)


def _images(size=IMAGE, channels=3):
    def make():
        from .. import weights as w

        return w.normal((B, size, size, channels))

    return make


def _vit_encoder(m, size=IMAGE):
    return m.ViTBackbone(
        image_shape=(size, size, 3),
        patch_size=4,
        num_layers=1,
        num_heads=4,
        hidden_dim=32,
        mlp_dim=64,
    )


def _clip(m):
    vision = m.CLIPVisionEncoder(
        patch_size=4,
        hidden_dim=32,
        num_layers=1,
        num_heads=4,
        intermediate_dim=64,
        image_shape=(IMAGE, IMAGE, 3),
    )
    text = m.CLIPTextEncoder(
        vocabulary_size=VOCAB,
        embedding_dim=32,
        hidden_dim=32,
        num_layers=1,
        num_heads=4,
        intermediate_dim=64,
        max_sequence_length=T,
    )
    return m.CLIPBackbone(vision, text, projection_dim=16)


def _siglip(m):
    vision = m.SigLIPVisionEncoder(
        patch_size=4,
        hidden_dim=32,
        num_layers=1,
        num_heads=4,
        intermediate_dim=64,
        image_shape=(IMAGE, IMAGE, 3),
    )
    text = m.SigLIPTextEncoder(
        vocabulary_size=VOCAB,
        embedding_dim=32,
        hidden_dim=32,
        num_layers=1,
        num_heads=4,
        intermediate_dim=64,
        max_sequence_length=T,
    )
    return m.SigLIPBackbone(vision, text)


def _sam(m):
    from keras_hub.layers import SAMMaskDecoder, SAMPromptEncoder

    encoder = m.ViTDetBackbone(
        hidden_size=32,
        num_layers=2,
        intermediate_dim=64,
        num_heads=4,
        global_attention_layer_indices=[1],
        image_shape=(IMAGE, IMAGE, 3),
        patch_size=4,
        window_size=4,
        num_output_channels=16,
    )
    prompt = SAMPromptEncoder(
        hidden_size=16,
        image_embedding_size=(16, 16),
        input_image_size=(IMAGE, IMAGE),
        mask_in_channels=4,
    )
    decoder = SAMMaskDecoder(
        hidden_size=16,
        num_layers=1,
        intermediate_dim=32,
        num_heads=2,
        embedding_dim=16,
        num_multimask_outputs=3,
        iou_head_depth=2,
        iou_head_hidden_dim=16,
    )
    return m.SAMBackbone(image_encoder=encoder, prompt_encoder=prompt, mask_decoder=decoder)


def _sam_prompts():
    import jax.numpy as jnp

    from .. import weights as w

    return {
        "points": lambda: jnp.abs(w.normal((B, 2, 2))) * 16,
        "labels": lambda: jnp.ones((B, 2), jnp.float32),
        "boxes": lambda: jnp.abs(w.normal((B, 1, 2, 2), 1)) * 16,
        "masks": lambda: jnp.zeros((B, 0, IMAGE, IMAGE, 1), jnp.float32),
    }


#: Moonshine's audio front end strides by 64 * 3 * 2: 384 samples a frame.
_MOON_FRAMES = 128


def _moonshine_inputs():
    import jax.numpy as jnp

    from .. import weights as w

    n = 384 * _MOON_FRAMES
    return {
        "encoder_input_values": lambda: w.normal((B, n, 1)),
        "encoder_padding_mask": lambda: w.padding(B, n, n - 384 * 8).astype(jnp.bool_),
    }


def _mit(m):
    return m.MiTBackbone(
        layerwise_depths=[1, 1],
        num_layers=2,
        layerwise_num_heads=[1, 2],
        layerwise_sr_ratios=[4, 2],
        max_drop_path_rate=0.0,
        layerwise_patch_sizes=[7, 3],
        layerwise_strides=[4, 2],
        image_shape=(IMAGE, IMAGE, 3),
        hidden_dims=[16, 32],
    )


def _segformer(m):
    return m.SegFormerBackbone(image_encoder=_mit(m), projection_filters=16)


def _whisper(m):
    return m.WhisperBackbone(
        **MHA, num_mels=16, max_encoder_sequence_length=2 * T, max_decoder_sequence_length=T
    )


def _whisper_features():
    from .. import weights as w

    return w.normal((B, 2 * T, 16))


_LM_MODES = ("direct", "jit", "train", "export")

MODELS = [
    # decoder-only
    _m(
        "GPT-2",
        "decoder",
        _backbone(lambda m: m.GPT2Backbone(**MHA, max_sequence_length=2 * T)),
        True,
    ),
    _m("OPT", "decoder", _backbone(lambda m: m.OPTBackbone(**MHA, max_sequence_length=2 * T))),
    _m("BLOOM", "decoder", _backbone(lambda m: m.BloomBackbone(**MHA))),
    _m(
        "GPT-NeoX",
        "decoder",
        _backbone(lambda m: m.GPTNeoXBackbone(**MHA, max_sequence_length=2 * T)),
    ),
    _m("Falcon", "decoder", _backbone(lambda m: m.FalconBackbone(**TXT, num_attention_heads=4))),
    _m("Llama", "decoder", _backbone(lambda m: m.LlamaBackbone(**GQA))),
    _m("Llama 3", "decoder", _backbone(lambda m: m.Llama3Backbone(**GQA))),
    _m("Mistral", "decoder", _backbone(lambda m: m.MistralBackbone(**GQA, sliding_window=64))),
    _m("Mixtral", "decoder", _backbone(lambda m: m.MixtralBackbone(**GQA, num_experts=4, top_k=2))),
    _m("Qwen", "decoder", _backbone(lambda m: m.QwenBackbone(**GQA))),
    _m("Qwen3", "decoder", _backbone(lambda m: m.Qwen3Backbone(**GQA, head_dim=8))),
    _m(
        "Qwen-MoE",
        "decoder",
        _backbone(
            lambda m: m.QwenMoeBackbone(
                **GQA,
                moe_intermediate_dim=32,
                shared_expert_intermediate_dim=32,
                num_experts=4,
                top_k=2,
            )
        ),
    ),
    _m(
        "Qwen3-MoE",
        "decoder",
        _backbone(
            lambda m: m.Qwen3MoeBackbone(
                **GQA, moe_intermediate_dim=32, num_experts=4, top_k=2, head_dim=8
            )
        ),
    ),
    _m("Phi-3", "decoder", _backbone(lambda m: m.Phi3Backbone(**GQA))),
    _m(
        "Gemma",
        "decoder",
        _backbone(lambda m: m.GemmaBackbone(**dict(GQA, num_key_value_heads=1), head_dim=8)),
    ),
    _m(
        "Gemma 2",
        "decoder",
        _backbone(
            lambda m: m.GemmaBackbone(
                **GQA,
                head_dim=8,
                query_head_dim_normalize=False,
                use_post_ffw_norm=True,
                use_post_attention_norm=True,
                final_logit_soft_cap=30.0,
                attention_logit_soft_cap=50.0,
                sliding_window_size=64,
                use_sliding_window_attention=True,
            )
        ),
    ),
    _m(
        "Gemma 3",
        "decoder",
        _backbone(
            lambda m: m.Gemma3Backbone(
                **GQA,
                head_dim=8,
                sliding_window_size=64,
                use_sliding_window_attention=True,
                global_layer_interval=2,
                image_size=896,
                vision_encoder=None,
            )
        ),
    ),
    _m(
        "gpt-oss",
        "decoder",
        _backbone(lambda m: m.GptOssBackbone(**GQA, head_dim=8, num_experts=4, top_k=2)),
    ),
    # encoders
    _m(
        "BERT",
        "encoder",
        _backbone(lambda m: m.BertBackbone(**MHA, max_sequence_length=2 * T)),
        True,
    ),
    _m(
        "RoBERTa",
        "encoder",
        _backbone(lambda m: m.RobertaBackbone(**MHA, max_sequence_length=2 * T)),
    ),
    _m(
        "XLM-RoBERTa",
        "encoder",
        _backbone(lambda m: m.XLMRobertaBackbone(**MHA, max_sequence_length=2 * T)),
    ),
    _m(
        "DistilBERT",
        "encoder",
        _backbone(lambda m: m.DistilBertBackbone(**MHA, max_sequence_length=2 * T)),
    ),
    _m(
        "ALBERT",
        "encoder",
        _backbone(lambda m: m.AlbertBackbone(**MHA, embedding_dim=16, max_sequence_length=2 * T)),
    ),
    _m(
        "ELECTRA",
        "encoder",
        _backbone(
            lambda m: m.ElectraBackbone(
                vocab_size=VOCAB,
                num_layers=2,
                num_heads=4,
                hidden_dim=32,
                embedding_dim=16,
                intermediate_dim=64,
                max_sequence_length=2 * T,
            )
        ),
    ),
    _m(
        "DeBERTaV3",
        "encoder",
        _backbone(lambda m: m.DebertaV3Backbone(**MHA, max_sequence_length=2 * T, bucket_size=32)),
    ),
    _m("ESM-2", "encoder", _backbone(lambda m: m.ESM2Backbone(**MHA))),
    _m(
        "RoFormerV2",
        "encoder",
        _backbone(lambda m: m.RoformerV2Backbone(**MHA, head_size=8, max_wavelength=10000)),
    ),
    _m("XLNet", "encoder", _backbone(lambda m: m.XLNetBackbone(**MHA))),
    # encoder-decoders
    _m(
        "BART",
        "encoder-decoder",
        _backbone(lambda m: m.BartBackbone(**MHA, max_sequence_length=2 * T)),
        True,
    ),
    _m("T5", "encoder-decoder", _backbone(lambda m: m.T5Backbone(**MHA, key_value_dim=8))),
    _m(
        "Whisper",
        "speech",
        _backbone(
            _whisper,
            inputs={"encoder_features": lambda: _whisper_features()},
            notes="16 mel bins, 512 frames",
        ),
        True,
    ),
    _m(
        "Moonshine",
        "speech",
        _backbone(
            lambda m: m.MoonshineBackbone(
                vocabulary_size=VOCAB,
                filter_dim=16,
                encoder_num_layers=1,
                decoder_num_layers=1,
                hidden_dim=32,
                intermediate_dim=64,
                encoder_num_heads=4,
                decoder_num_heads=4,
            ),
            seq=(T, _MOON_FRAMES),
            inputs=_moonshine_inputs(),
        ),
    ),
    # vision
    _m("ViT", "vision", _backbone(_vit_encoder, seq=(257, 257)), True),
    _m(
        "DeiT",
        "vision",
        _backbone(
            lambda m: m.DeiTBackbone(
                image_shape=(IMAGE, IMAGE, 3),
                patch_size=4,
                num_layers=1,
                num_heads=4,
                hidden_dim=32,
                intermediate_dim=64,
            ),
            seq=(258, 258),
        ),
    ),
    _m(
        "DINOv2",
        "vision",
        _backbone(
            lambda m: m.DINOV2Backbone(
                patch_size=4,
                num_layers=1,
                hidden_dim=32,
                num_heads=4,
                intermediate_dim=64,
                image_shape=(IMAGE, IMAGE, 3),
            ),
            seq=(257, 257),
        ),
    ),
    _m("CLIP", "vision", _backbone(_clip, seq=(257, 257))),
    _m("SigLIP", "vision", _backbone(_siglip, seq=(256, 256))),
    _m(
        "Swin",
        "vision",
        _backbone(
            lambda m: m.SwinTransformerBackbone(
                image_shape=(IMAGE, IMAGE, 3),
                embed_dim=16,
                depths=(1, 1),
                num_heads=(2, 4),
                window_size=8,
            ),
            seq=(64, 64),
        ),
    ),
    _m(
        "ViTDet",
        "vision",
        _backbone(
            lambda m: m.ViTDetBackbone(
                hidden_size=32,
                num_layers=2,
                intermediate_dim=64,
                num_heads=4,
                global_attention_layer_indices=[1],
                image_shape=(IMAGE, IMAGE, 3),
                patch_size=4,
                window_size=4,
                num_output_channels=16,
            ),
            seq=(256, 256),
        ),
    ),
    _m("SAM", "vision", _backbone(_sam, seq=(256, 256), inputs=_sam_prompts())),
    _m("SegFormer", "vision", _backbone(_segformer, seq=(256, 16))),
]
