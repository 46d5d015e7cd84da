"""PyTorch models run as JAX functions through torchax: Hugging Face transformers
(Llama, Mistral, Qwen2, GPT-2, BERT, T5), ``torch.nn.MultiheadAttention`` and
diffusers' attention processors.

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
    "gpt2-eager": (lambda t: _gpt2("eager", t), lambda t: (_tokens(t),)),
    "gpt2-sdpa": (lambda t: _gpt2("sdpa", t), lambda t: (_tokens(t),)),
    "bert-eager-padding": (_bert, lambda t: (_tokens(t), _padding(t))),
    "t5-encoder": (_t5, lambda t: (_tokens(t),)),
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
    "multihead-attention": "nn.MultiheadAttention, need_weights=False (SDPA)",
    "multihead-attention-weights": "nn.MultiheadAttention, need_weights=True (bmm, weights unused)",
    "diffusers-AttnProcessor": "Attention + AttnProcessor (baddbmm on [B·H, T, D])",
    "diffusers-AttnProcessor-cross": "Attention + AttnProcessor, UNet cross-attention (T != S)",
    "diffusers-AttnProcessor-padding": "Attention + AttnProcessor, padding (baddbmm, beta=1)",
    "diffusers-AttnProcessor2_0": "Attention + AttnProcessor2_0 (SDPA)",
}


def _library(case) -> str:
    family = case.split("-")[0]
    library = {"diffusers": "diffusers", "multihead": "torch.nn"}.get(family, "transformers")
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


@pytest.mark.parametrize("case", sorted(MODELS))
def test_torchax_model(case, check_model):
    fn, weights, inputs = _jax_model(case)
    check_model(
        fn, weights, *inputs, library=_library(case), case=CASES[case], sites=1,
        where=WHERE,
    )  # fmt: skip


def _train_step(fn):
    def step(weights, *args):
        return jax.value_and_grad(lambda w: jnp.mean(jnp.sin(fn(w, *args))))(weights)

    return step


@pytest.mark.parametrize(
    "case",
    [
        "llama-eager",
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
