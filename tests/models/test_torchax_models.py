"""PyTorch models run as JAX functions through torchax: Hugging Face transformers
(Llama, Mistral, Qwen2, Gemma 2/3, GPT-2, BERT, T5, BART, ViT),
``torch.nn.MultiheadAttention``/``TransformerEncoder`` and diffusers' attention
processors.

``torchax.extract_jax(module)`` gives the module's weights as JAX arrays and a
JAX function of them; its attention arrives in PyTorch's own spellings: a 4-D
``torch.matmul`` decomposed into a reshape to ``[B·H, T, D]``, a ``bmm`` and a
view back, ``bmm``/``baddbmm`` on merged heads, torchax's SDPA reference with
its ``zeros(L, S)`` bias.  Each test checks (``check_model``, conftest.py) that
every site is rewritten, in every first-call context, and that outputs and
gradients equal the same program's without flashpass; the training test traces
``jax.value_and_grad`` inside the step and checks that no T×S array is left.

Batch 2: at batch 1 the merged ``B·H`` axis is the head axis alone.  Tiny
configs, random weights, nothing downloaded.  Needs torch and torchax (not in
the test extras): skipped without them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from t_by_s import assert_no_t_by_s, jaxpr_shapes

import flashpass

torch = pytest.importorskip("torch")
torchax = pytest.importorskip("torchax")
tr = pytest.importorskip("transformers")

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

B, T, VOCAB, WIDTH, HEADS = 2, 32, 128, 64, 4
CONTEXT, CONTEXT_WIDTH = 40, 48  # diffusers cross-attention: encoder states
#: Where every rewrite's location lies: torchax's lowering of the PyTorch op.
WHERE = ("torchax/", "transformers/", "diffusers/", "torch/")


def _llama_like(cls_name, impl, t=T, **extra):
    cfg = getattr(tr, cls_name.replace("Model", "Config"))(
        vocab_size=VOCAB,
        hidden_size=WIDTH,
        intermediate_size=2 * WIDTH,
        num_hidden_layers=1,
        num_attention_heads=HEADS,
        num_key_value_heads=2,
        max_position_embeddings=t,
        attn_implementation=impl,
        use_cache=False,
        **extra,
    )
    return getattr(tr, cls_name)(cfg)


def _gpt2(impl, t=T):
    cfg = tr.GPT2Config(
        vocab_size=VOCAB, n_embd=WIDTH, n_layer=1, n_head=HEADS, n_positions=t,
        attn_implementation=impl, use_cache=False,
    )  # fmt: skip
    return tr.GPT2Model(cfg)


def _bert(t=T):
    # BERT's SDPA mask builder tests the mask's values in Python (torch.all(mask
    # == 1)), which a traced torchax tensor cannot answer: eager attention only.
    cfg = tr.BertConfig(
        vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=1, num_attention_heads=HEADS,
        intermediate_size=2 * WIDTH, max_position_embeddings=t, attn_implementation="eager",
    )  # fmt: skip
    return tr.BertModel(cfg)


def _t5(t=T):
    cfg = tr.T5Config(
        vocab_size=VOCAB, d_model=WIDTH, d_kv=WIDTH // HEADS, d_ff=2 * WIDTH, num_layers=1,
        num_heads=HEADS, use_cache=False,
    )  # fmt: skip
    return tr.T5EncoderModel(cfg)


def _bart(t=T):
    # Encoder self-attention, decoder causal self-attention, cross-attention.
    # BART's SDPA mask builder also tests mask values in Python: eager only.
    cfg = tr.BartConfig(
        vocab_size=VOCAB, d_model=WIDTH, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=HEADS, decoder_attention_heads=HEADS, encoder_ffn_dim=2 * WIDTH,
        decoder_ffn_dim=2 * WIDTH, max_position_embeddings=t, use_cache=False,
        attn_implementation="eager",
    )  # fmt: skip
    return tr.BartModel(cfg)


IMAGE, PATCH = 32, 4  # ViT: (32 / 4)² patches and a class token, 65 positions


def _vit(impl):
    cfg = tr.ViTConfig(
        hidden_size=WIDTH, num_hidden_layers=1, num_attention_heads=HEADS,
        intermediate_size=2 * WIDTH, image_size=IMAGE, patch_size=PATCH,
        attn_implementation=impl,
    )  # fmt: skip
    return tr.ViTModel(cfg, add_pooling_layer=False)


class _Gemma(torch.nn.Module):
    """Gemma 2 or 3 with one layer, given its mask as a ``{layer type: additive
    [B, 1, T, T] mask}`` dict (a mask Hugging Face accepts as built): torchax
    cannot build the sliding-window mask itself (transformers' mask builder
    converts the window to an int torchax then asks the dtype of), and both
    models build it even when no layer slides.  ``window``: one sliding layer
    of that width, else one full causal layer."""

    def __init__(self, cls_name, impl, t, window=0):
        super().__init__()
        config = getattr(tr, cls_name.replace("TextModel", "TextConfig").replace("Model", "Config"))
        cfg = config(
            vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=2 * WIDTH,
            num_hidden_layers=1, num_attention_heads=HEADS, num_key_value_heads=2,
            head_dim=WIDTH // HEADS, max_position_embeddings=t, use_cache=False,
            attn_implementation=impl, sliding_window=window or t,
            layer_types=["sliding_attention" if window else "full_attention"],
        )  # fmt: skip
        self.model = getattr(tr, cls_name)(cfg)
        self.window = window

    def forward(self, ids):
        t = ids.shape[1]
        i = torch.ones_like(ids[0]).cumsum(0) - 1  # arange, as a traced tensor
        keep = i[None, :] <= i[:, None]
        if self.window:
            keep = keep & (i[:, None] - i[None, :] < self.window)
        mask = torch.zeros_like(keep, dtype=torch.float32)
        mask = mask.masked_fill(~keep, torch.finfo(torch.float32).min)
        mask = mask[None, None].expand(ids.shape[0], 1, t, t)
        masks = {"full_attention": mask, "sliding_attention": mask}
        return self.model(ids, attention_mask=masks).last_hidden_state


class _Encoder(torch.nn.Module):
    """``nn.TransformerEncoder``; ``mask``: "padding" (``src_key_padding_mask``,
    merged over heads as a ``[B·H, 1, S]`` -inf bias and viewed back) or
    "causal-padding" (with a causal ``mask`` too, the two summed on ``[B·H, T, S]``)."""

    def __init__(self, mask=None):
        super().__init__()
        layer = torch.nn.TransformerEncoderLayer(
            WIDTH, HEADS, 2 * WIDTH, dropout=0.0, batch_first=True
        )
        self.encoder = torch.nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.mask = mask

    def forward(self, x, padding=None):
        if self.mask is None:
            return self.encoder(x)
        if self.mask == "padding":
            return self.encoder(x, src_key_padding_mask=padding == 0)
        i = torch.ones_like(padding[0]).cumsum(0) - 1  # arange, as a traced tensor
        causal = i[None, :] > i[:, None]  # True: not attended
        return self.encoder(x, mask=causal, src_key_padding_mask=padding == 0, is_causal=True)


class _MHA(torch.nn.Module):
    def __init__(self, need_weights: bool):
        super().__init__()
        self.attn = torch.nn.MultiheadAttention(WIDTH, HEADS, batch_first=True)
        self.need_weights = need_weights

    def forward(self, x):
        return self.attn(x, x, x, need_weights=self.need_weights)[0]


class _Diffusers(torch.nn.Module):
    """diffusers' ``Attention`` with a processor; ``cross``: a UNet's
    cross-attention to ``CONTEXT`` encoder states of width ``CONTEXT_WIDTH``."""

    def __init__(self, processor: str, extra: str | None = None):
        super().__init__()
        attention = pytest.importorskip("diffusers.models.attention_processor")
        proc = getattr(attention, processor)()
        self.extra = extra
        self.attn = attention.Attention(
            WIDTH,
            cross_attention_dim=CONTEXT_WIDTH if extra == "context" else None,
            heads=HEADS,
            dim_head=WIDTH // HEADS,
            processor=proc,
        )

    def forward(self, x, extra=None):
        if self.extra == "context":
            return self.attn(x, encoder_hidden_states=extra)
        if self.extra == "keep":
            # [B, S] key padding as an additive [B, 1, S] mask: diffusers repeats
            # it to [B·H, 1, S] (prepare_attention_mask) for baddbmm with beta=1.
            mask = torch.where(extra.bool(), 0.0, -10000.0)[:, None, :]
            return self.attn(x, attention_mask=mask)
        return self.attn(x)


def _context(t=T):
    # encoder states: more keys than queries (T != S)
    shape = (B, t + CONTEXT - T, CONTEXT_WIDTH)
    return jnp.asarray(np.random.default_rng(2).standard_normal(shape), jnp.float32)


def _tokens(t=T):
    return jnp.asarray(np.random.default_rng(0).integers(0, VOCAB, (B, t)), jnp.int32)


def _padding(t=T):
    return jnp.ones((B, t), jnp.int32).at[1, -5:].set(0)


def _image(t=T):
    shape = (B, 3, IMAGE, IMAGE)
    return jnp.asarray(np.random.default_rng(3).standard_normal(shape), jnp.float32)


def _hidden(t=T):
    return jnp.asarray(np.random.default_rng(1).standard_normal((B, t, WIDTH)), jnp.float32)


#: case -> (module builder, inputs builder).  Hugging Face models get no
#: padding mask except BERT (a causal LM builds its own).
MODELS = {
    "llama-eager": (lambda t: _llama_like("LlamaModel", "eager", t), lambda t: (_tokens(t),)),
    "llama-sdpa": (lambda t: _llama_like("LlamaModel", "sdpa", t), lambda t: (_tokens(t),)),
    "mistral-eager": (  # (a sliding window torchax converts to an int it cannot type)
        lambda t: _llama_like("MistralModel", "eager", t, sliding_window=None),
        lambda t: (_tokens(t),),
    ),
    "qwen2-sdpa": (lambda t: _llama_like("Qwen2Model", "sdpa", t), lambda t: (_tokens(t),)),
    "gemma2-eager-softcap": (  # soft-capped logits (eager only), full causal layer
        lambda t: _Gemma("Gemma2Model", "eager", t),
        lambda t: (_tokens(t),),
    ),
    "gemma3-sdpa-window": (
        lambda t: _Gemma("Gemma3TextModel", "sdpa", t, window=8),
        lambda t: (_tokens(t),),
    ),
    "gpt2-eager": (lambda t: _gpt2("eager", t), lambda t: (_tokens(t),)),
    "gpt2-sdpa": (lambda t: _gpt2("sdpa", t), lambda t: (_tokens(t),)),
    "bert-eager-padding": (_bert, lambda t: (_tokens(t), _padding(t))),
    "t5-encoder": (_t5, lambda t: (_tokens(t),)),
    "bart-eager": (_bart, lambda t: (_tokens(t),)),
    "vit-eager": (lambda t: _vit("eager"), lambda t: (_image(t),)),
    "vit-sdpa": (lambda t: _vit("sdpa"), lambda t: (_image(t),)),
    "transformer-encoder": (lambda t: _Encoder(), lambda t: (_hidden(t),)),
    "transformer-encoder-padding": (
        lambda t: _Encoder("padding"),
        lambda t: (_hidden(t), _padding(t)),
    ),
    "transformer-encoder-causal-padding": (
        lambda t: _Encoder("causal-padding"),
        lambda t: (_hidden(t), _padding(t)),
    ),
    "multihead-attention": (lambda t: _MHA(False), lambda t: (_hidden(t),)),
    "multihead-attention-weights": (lambda t: _MHA(True), lambda t: (_hidden(t),)),
    "diffusers-AttnProcessor": (lambda t: _Diffusers("AttnProcessor"), lambda t: (_hidden(t),)),
    "diffusers-AttnProcessor-cross": (
        lambda t: _Diffusers("AttnProcessor", "context"),
        lambda t: (_hidden(t), _context(t)),
    ),
    "diffusers-AttnProcessor-padding": (
        lambda t: _Diffusers("AttnProcessor", "keep"),
        lambda t: (_hidden(t), _padding(t)),
    ),
    "diffusers-AttnProcessor2_0": (
        lambda t: _Diffusers("AttnProcessor2_0"),
        lambda t: (_hidden(t),),
    ),
}


#: Sites per model (one unless named).
SITES = {"bart-eager": 3}

#: The coverage table's words for each case (docs/coverage.md).
CASES = {
    "llama-eager": "Llama (GQA), eager: 4-D matmul as reshape, bmm, view",
    "llama-sdpa": "Llama (GQA), SDPA: torchax's reference with its zeros bias",
    "mistral-eager": "Mistral (GQA), eager",
    "qwen2-sdpa": "Qwen2 (GQA), SDPA",
    "gpt2-eager": "GPT-2, eager (causal buffer, where)",
    "gpt2-sdpa": "GPT-2, SDPA",
    "bert-eager-padding": "BERT, eager, padding mask",
    "t5-encoder": "T5 encoder (relative bias, no scaling)",
    "gemma2-eager-softcap": "Gemma 2 (GQA), eager, soft-cap, causal mask given",
    "gemma3-sdpa-window": "Gemma 3 (GQA), SDPA, sliding-window mask given",
    "bart-eager": "BART, eager: encoder, causal decoder, cross-attention",
    "vit-eager": "ViT, eager (65 patches and class token)",
    "vit-sdpa": "ViT, SDPA",
    "transformer-encoder": "nn.TransformerEncoder (MultiheadAttention inside)",
    "transformer-encoder-padding": "nn.TransformerEncoder, key padding (-inf, via [B·H, 1, S])",
    "transformer-encoder-causal-padding": "nn.TransformerEncoder, causal and key padding",
    "multihead-attention": "nn.MultiheadAttention, need_weights=False (SDPA)",
    "multihead-attention-weights": "nn.MultiheadAttention, need_weights=True (bmm, weights unused)",
    "diffusers-AttnProcessor": "Attention + AttnProcessor (baddbmm on [B·H, T, D])",
    "diffusers-AttnProcessor-cross": "Attention + AttnProcessor, UNet cross-attention (T != S)",
    "diffusers-AttnProcessor-padding": "Attention + AttnProcessor, padding (baddbmm, beta=1)",
    "diffusers-AttnProcessor2_0": "Attention + AttnProcessor2_0 (SDPA)",
}


def _library(case) -> str:
    family = case.split("-")[0]
    libraries = {"diffusers": "diffusers", "multihead": "torch.nn", "transformer": "torch.nn"}
    library = libraries.get(family, "transformers")
    return f"{library} via torchax"


def _jax_model(case, t=T):
    """``(fn, weights, inputs)``: the module as ``fn(weights, *inputs)`` -> array,
    ``weights`` its floating-point parameters (integer and boolean buffers, such
    as position ids and GPT-2's causal mask, are constants of ``fn``)."""
    build, inputs = MODELS[case]
    torch.manual_seed(0)
    state, call = torchax.extract_jax(build(t).eval())
    weights = {k: x for k, x in state.items() if jnp.issubdtype(x.dtype, jnp.floating)}
    buffers = {k: x for k, x in state.items() if k not in weights}

    def fn(weights, *args):
        out = call({**weights, **buffers}, args)
        return out if isinstance(out, jax.Array) else out[0]

    return fn, weights, inputs(t)


#: Cases kept, with why.
XFAIL = {
    "transformer-encoder-causal-padding": (
        "the causal mask and the key padding are summed on the merged [B·H, T, S] "
        "axis before the view back to [B, H, T, S]; the mask reader does not split "
        "a reshape through that sum, so the -inf bias stays dense and torch's "
        "safe-softmax guard after it keeps the site"
    ),
}


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(c, marks=pytest.mark.xfail(strict=True, reason=XFAIL[c])) if c in XFAIL else c
        for c in sorted(MODELS)
    ],
)
def test_torchax_model(case, check_model):
    fn, weights, inputs = _jax_model(case)
    check_model(
        fn, weights, *inputs, library=_library(case), case=CASES[case],
        sites=SITES.get(case, 1), where=WHERE,
    )  # fmt: skip


def _train_step(fn):
    def step(weights, *args):
        return jax.value_and_grad(lambda w: jnp.mean(jnp.sin(fn(w, *args))))(weights)

    return step


@pytest.mark.parametrize(
    "case",
    [
        "llama-eager",
        "gemma2-eager-softcap",
        "gpt2-sdpa",
        "diffusers-AttnProcessor-cross",
        "diffusers-AttnProcessor-padding",
    ],
)
def test_torchax_training_step(case, record_coverage):
    # value_and_grad of a loss inside the step (the first call under jax.jit):
    # the forward and autodiff's backward of every site are the kernel's, the
    # loss and gradients equal the original step's, and no T×S array is left.
    fn, weights, inputs = _jax_model(case)
    step = _train_step(fn)
    opt = flashpass.optimize(step, kernel="blockwise")
    loss, grads = jax.jit(opt)(weights, *inputs)
    report = opt.reports[-1]
    case_words = f"{CASES[case]}, value_and_grad train step"
    record_coverage(report, library=_library(case), case=case_words, sites=1)
    assert len(report.rewrites) == 1 and not report.fallbacks, str(report)
    assert all(r.backward for r in report.rewrites), str(report)
    want_loss, want_grads = jax.jit(step)(weights, *inputs)
    np.testing.assert_allclose(loss, want_loss, rtol=2e-5)
    scale = max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(want_grads))
    for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(g, w, atol=2e-5 * scale)
    # Traced only, at a length above the kernel's tiles (at T = 32 one tile is
    # the whole score matrix); a tile with a dense bias is one head's [T, S]
    # block, hence two copies (the original holds B·H).
    t = 1024
    fn, weights, inputs = _jax_model(case, t)
    step = _train_step(fn)
    control = jaxpr_shapes(jax.make_jaxpr(step)(weights, *inputs))
    rewritten = flashpass.optimize(step, kernel="blockwise").rewritten_jaxpr(weights, *inputs)
    shapes = jaxpr_shapes(rewritten)
    s = t + CONTEXT - T if case.endswith("cross") else t
    assert_no_t_by_s(shapes, t, s, copies=2, control=control)
