"""timm 1.0 vision models with attention, run as JAX through torchax.

Each model is ``timm.create_model(name, pretrained=False, num_classes=10,
...)`` with PyTorch's own random init under a fixed seed (nothing downloaded):
the plain and class-attention ViTs shrunk to width 64, 4 heads, 2 blocks,
MLP ratio 2 (no activation as big as a 256 x 256 score matrix) on
64x64 images with 4x4 patches (256 patches, plus class tokens); the
hierarchical ones (windowed, pyramid, hybrid conv-attention) at their
smallest named variant, with fewer blocks where the constructor takes a
depth, on 64x64 images (128 where attention only starts at stride 16, so
that its sequences reach the detector's length; 224 where a fixed
attention-bias grid needs it).
Batch 2.  The training step's loss is the mean square of the logits.  timm
has no generation and the forward is swept as a ``jax.export`` artifact
where ``jax.export`` takes it.
"""

from __future__ import annotations

from ..model import Built, ZooModel

SUITE = "timm"
B = 2
_VIT = dict(img_size=64, patch_size=4, embed_dim=64, depth=2, num_heads=4, mlp_ratio=2.0)
_SWIN = dict(
    img_size=64, patch_size=2, window_size=8, embed_dim=32, depths=(1, 1), num_heads=(2, 4)
)


def _uncached_attention_biases(module):
    """LeViT and EfficientFormer(V2) cache their gathered attention bias in a
    dict in eval mode (``get_attention_biases``): under a JAX trace the cache
    keeps the first trace's tracer and the next trace fails.  Gather it on
    every call instead (the same values: what training mode does)."""
    for sub in module.modules():
        if hasattr(sub, "attention_bias_cache") and hasattr(sub, "get_attention_biases"):
            sub.get_attention_biases = lambda device, m=sub: m.attention_biases[
                :, m.attention_bias_idxs
            ]


def build(name, kwargs, image):
    def make():
        from .hf_torch import as_jax, exportable, measured_seq, setup, sq_loss

        torch, _ = setup()
        import timm

        from ..weights import normal

        torch.manual_seed(0)
        module = timm.create_model(name, pretrained=False, num_classes=10, **kwargs)
        _uncached_attention_biases(module)
        forward, params = as_jax(module)
        inputs = (normal((B, 3, image, image), seed=3),)
        shown = ", ".join(f"{k}={v}" for k, v in kwargs.items())
        return Built(
            forward,
            params,
            inputs,
            loss=sq_loss(forward),
            seq=measured_seq(forward, params, inputs, (image, image)),
            notes=f"B={B}, {image}x{image} images; {shown or 'default config'}",
            export=exportable(forward, params, inputs),
        )

    return make


#: (timm name, family, create_model overrides, image side, sample).  The
#: ``T x S`` checks use the largest score array the independent detector
#: finds (`measured_seq`).
_ENTRIES = [
    # plain ViTs: global attention over the patches (and class/register tokens)
    ("vit_tiny_patch16_224", "vit", _VIT, 64, True),
    ("deit_tiny_distilled_patch16_224", "vit", _VIT, 64, False),
    ("deit3_small_patch16_224", "vit", _VIT, 64, False),
    ("vit_relpos_small_patch16_224", "vit", _VIT, 64, False),
    ("vit_base_patch16_siglip_224", "vit", _VIT, 64, False),
    ("flexivit_small", "vit", _VIT, 64, False),
    ("vit_small_patch16_rope_224", "vit", _VIT, 64, False),
    ("beit_base_patch16_224", "vit", _VIT, 64, False),
    ("beitv2_base_patch16_224", "vit", _VIT, 64, False),
    ("eva02_tiny_patch14_224", "vit", _VIT, 64, False),
    (
        "samvit_base_patch16",
        "vit",
        dict(_VIT, global_attn_indexes=(1,), window_size=8, neck_chans=32),
        64,
        False,
    ),
    ("convit_tiny", "vit", dict(img_size=64, depth=2, local_up_to_layer=1), 64, False),
    ("tnt_s_patch16_224", "vit", dict(img_size=64, depth=2), 64, False),
    # class attention (a class token attending to the patches) and channel attention
    ("cait_xxs24_224", "class-attention", _VIT, 64, True),
    ("xcit_nano_12_p16_224", "class-attention", dict(_VIT, patch_size=16), 64, False),
    ("volo_d1_224", "class-attention", dict(img_size=64), 64, False),
    # windowed and hierarchical
    ("swin_tiny_patch4_window7_224", "window", _SWIN, 64, True),
    ("swinv2_tiny_window8_256", "window", _SWIN, 64, False),
    ("maxvit_rmlp_nano_rw_256", "window", dict(img_size=64), 64, False),
    ("coatnet_nano_rw_224", "window", dict(img_size=128), 128, False),
    ("gcvit_xxtiny", "window", dict(img_size=64), 64, False),
    ("davit_tiny", "window", dict(depths=(1, 1, 1, 1)), 64, False),
    ("nest_tiny_jx", "window", dict(img_size=64), 64, False),
    ("hiera_tiny_224", "window", dict(img_size=64), 64, False),
    # pyramid: pooled or spatially reduced keys
    ("mvitv2_tiny", "pyramid", dict(img_size=64), 64, False),
    ("twins_pcpvt_small", "pyramid", dict(img_size=64, depths=(1, 1, 1, 1)), 64, False),
    ("twins_svt_small", "pyramid", dict(img_size=64, depths=(1, 1, 1, 1)), 64, False),
    ("pvt_v2_b0", "pyramid", {}, 64, True),
    ("pit_ti_224", "pyramid", dict(img_size=64), 64, False),
    # hybrid conv-attention
    ("levit_128s", "hybrid", dict(img_size=128), 128, True),
    ("coat_lite_tiny", "hybrid", dict(img_size=64), 64, False),
    ("coat_tiny", "hybrid", dict(img_size=64), 64, False),
    ("visformer_tiny", "hybrid", dict(img_size=128), 128, False),
    ("efficientformer_l1", "hybrid", {}, 224, False),
    ("efficientformerv2_s0", "hybrid", dict(img_size=128), 128, False),
    ("fastvit_sa12", "hybrid", {}, 128, False),
    ("caformer_s18", "hybrid", {}, 128, False),
    ("edgenext_xx_small", "hybrid", {}, 64, False),
    ("nextvit_small", "hybrid", {}, 128, False),
    ("mobilevit_xxs", "hybrid", {}, 128, False),
]

MODELS = [
    ZooModel(
        SUITE,
        name,
        family,
        build(name, kwargs, image),
        modes=("direct", "jit", "train", "export"),
        sample=sample,
    )
    for name, family, kwargs, image, sample in _ENTRIES
]
