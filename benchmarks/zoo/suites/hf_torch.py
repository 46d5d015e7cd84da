"""Hugging Face ``transformers`` 5.x PyTorch models run as JAX through torchax.

``torchax.extract_jax(module)`` turns each model into a JAX function of its
state; the attention arrives in PyTorch's own spellings (a 4-D ``matmul``
decomposed to ``bmm`` on merged ``[B*H, T, D]`` operands, ``baddbmm``,
torchax's SDPA reference).  Models with both get two entries, ``[eager]`` and
``[sdpa]`` (``attn_implementation``).

Tiny configs (hidden 64, 4 heads of 16, 2 layers, 2 KV heads where the
model has grouped queries, MLPs of 128 so that no activation is as big as a
256 x 256 score matrix for the T x S checks: 64 where gate and up are one
fused projection of twice that width, Phi-3's and Mixtral's experts'; BLOOM,
whose MLP is 4x, has hidden 48), PyTorch's own random init under a fixed seed,
nothing downloaded.  Sequences of 256 (encoder-decoders: 256 encoder / 128
decoder tokens; vision: 256 patches and a class token; Whisper: 256 encoder
positions).  Text inputs carry a padding mask with the second example
right-padded by 37 tokens.  Causal LMs and seq2seq models train on their token
cross-entropy, the others on the mean square of their outputs.
Mixture-of-experts models run their experts with
``experts_implementation="batched_mm"`` (transformers 5's default,
``grouped_mm``, calls ``aten::_grouped_mm``, which torchax cannot lower).

transformers 5 imports the Hub's ``kernels`` package when it is installed,
and from the repository root that name is flashpass's own ``kernels/``
folder: the environment must not have the Hub's ``kernels`` installed
(``pip uninstall kernels`` after installing transformers).

``generate`` (causal LMs): transformers' own ``generate()`` is a Python loop
over a cache object the model mutates in place, which ``torchax.extract_jax``
(one traced ``forward``) cannot take whole; `greedy` writes the same greedy
decoding as one JAX function instead: each model call is a torchax program
of the static cache's tensors (a ``StaticCache`` rebuilt around them), a
prefill then a ``lax.fori_loop`` of one-token steps.  Where a model cannot
decode that way the record's notes say why and ``generate`` is ``None``.
"""

from __future__ import annotations

import os

from ..model import Built, ZooModel

SUITE = "hf_torch"
B, T, T_DEC, VOCAB = 2, 256, 128, 128
PAD = 37  # right padding of the second example
W, HEADS, KV, LAYERS = 64, 4, 2, 2
IMAGE, PATCH = 64, 4  # (64 / 4)^2 = 256 patches (+ a class token)


# --------------------------------------------------------------------------- torch through torchax
# (shared with the timm suite)


def setup():
    """Import torch and torchax quietly, offline, and seed torch's init."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    import torch
    import torchax

    torch.manual_seed(0)
    return torch, torchax


def as_jax(module):
    """``(forward, params)``: ``forward(params, *inputs)`` runs ``module(*inputs)``
    as JAX; ``params`` its floating-point state (integer and boolean buffers,
    such as position ids and GPT-2's causal buffer, are constants)."""
    import jax
    import jax.numpy as jnp

    _, torchax = setup()
    state, call = torchax.extract_jax(module.eval())
    params = {k: x for k, x in state.items() if jnp.issubdtype(x.dtype, jnp.floating)}
    buffers = {k: x for k, x in state.items() if k not in params}

    def forward(params, *inputs):
        out = call({**params, **buffers}, inputs)
        return out if isinstance(out, jax.Array) else tuple(out)

    return forward, params


def sq_loss(forward):
    """The mean square of every floating output: the training loss of models
    with no token head."""
    import jax
    import jax.numpy as jnp

    def loss(params, *inputs):
        out = forward(params, *inputs)
        leaves = [
            x for x in jax.tree_util.tree_leaves(out) if jnp.issubdtype(x.dtype, jnp.floating)
        ]
        return sum(jnp.mean(jnp.square(x.astype(jnp.float32))) for x in leaves)

    return loss


def token_loss(forward, targets_at=0, mask_at=None, shift=True):
    """Token cross-entropy of the (first) output's logits against the token
    ids among the inputs (``targets_at``), next-token when ``shift``, weighted
    by the padding mask among the inputs (``mask_at``)."""
    import jax
    import jax.numpy as jnp

    def loss(params, *inputs):
        out = forward(params, *inputs)
        logits = out if isinstance(out, jax.Array) else out[0]
        ids = inputs[targets_at]
        weight = jnp.ones(ids.shape, jnp.float32) if mask_at is None else inputs[mask_at]
        weight = weight.astype(jnp.float32)
        if shift:
            logits, ids, weight = logits[:, :-1], ids[:, 1:], weight[:, 1:]
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        nll = -jnp.take_along_axis(logp, ids[..., None].astype(jnp.int32), axis=-1)[..., 0]
        return jnp.sum(nll * weight) / jnp.maximum(jnp.sum(weight), 1.0)

    return loss


def exportable(forward, params, inputs) -> bool:
    """Whether ``jax.export`` takes the jitted forward (a torchax program that
    calls back into Python cannot be exported)."""
    import jax

    try:
        jax.export.export(jax.jit(forward))(params, *inputs)
    except Exception:
        return False
    return True


def measured_seq(forward, params, inputs, default):
    """``(T, S)`` of the largest softmax-like score array the independent
    detector finds in the forward (its last two axes), else ``default``."""
    import math

    import jax

    from ..checks import softmax_like_exps

    closed = jax.make_jaxpr(forward)(params, *inputs)
    shapes = [
        tuple(int(d) for d in scope.shape(node.out)) for scope, node in softmax_like_exps(closed)
    ]
    if not shapes:
        return default
    return max(shapes, key=math.prod)[-2:]


# --------------------------------------------------------------------------- inputs


def _ids(t=T, seed=0):
    from ..weights import ids

    return ids((B, t), VOCAB, seed)


def _mask(t=T):
    from ..weights import padding

    return padding(B, t, t - PAD)


def _pixels(size=IMAGE, channels=3):
    from ..weights import normal

    return normal((B, channels, size, size), seed=3)


# --------------------------------------------------------------------------- builders


def _tr():
    setup()
    import transformers

    return transformers


def _config(cfg_name, impl, **kwargs):
    tr = _tr()
    cfg = getattr(tr, cfg_name)(**kwargs)
    if impl is not None:
        cfg._attn_implementation = impl
        for sub in ("text_config", "vision_config", "encoder", "decoder"):
            if isinstance(getattr(cfg, sub, None), tr.PretrainedConfig):
                getattr(cfg, sub)._attn_implementation = impl
    cfg.use_cache = False
    return cfg


def _model(cls_name, cfg):
    setup()[0].manual_seed(0)
    return getattr(_tr(), cls_name)(cfg)


def _wrap(model, call):
    """A ``torch.nn.Module`` whose forward is ``call(model, *inputs)``."""
    torch, _ = setup()

    class Wrapped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, *inputs):
            return call(self.model, *inputs)

    return Wrapped()


def _built(module, inputs, loss_of, seq, notes, export=True):
    forward, params = as_jax(module)
    return Built(
        forward,
        params,
        inputs,
        loss=loss_of(forward),
        seq=seq,
        notes=notes,
        export=export and exportable(forward, params, inputs),
    )


GEN_PROMPT, GEN_NEW, GEN_CACHE = 32, 8, 48


def greedy(model):
    """Greedy decoding with a static KV cache as one JAX function
    ``generate(params, prompt)`` -> ``[B, GEN_NEW]`` token ids, or ``None``
    where the model cannot decode this way through torchax.

    Each call of the model is one torchax program of ``(ids, position,
    keys, values)``: a ``StaticCache`` of ``GEN_CACHE`` slots is rebuilt
    around the given ``[L, B, KV, GEN_CACHE, D]`` tensors, the model writes
    the new keys and values into it (``index_copy_`` at the cache
    position) and the updated tensors are returned.  A prefill of the prompt
    is followed by a ``lax.fori_loop`` of one-token steps."""
    import jax
    import jax.numpy as jnp

    torch, _ = setup()
    import transformers

    cfg = model.config

    class Step(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, ids, pos, keys, values):
            cache = transformers.StaticCache(config=cfg, max_cache_len=GEN_CACHE)
            for i, layer in enumerate(cache.layers):
                layer.keys, layer.values = keys[i], values[i]
                layer.batch_size, layer.num_heads = keys.shape[1], keys.shape[2]
                layer.k_head_dim = layer.v_head_dim = keys.shape[-1]
                layer.device = keys.device
                layer.cumulative_length = pos.clone()
                layer.is_initialized = True
            n = ids.shape[1]
            where = torch.arange(n, device=ids.device) + pos
            out = self.model(
                input_ids=ids, past_key_values=cache, cache_position=where,
                position_ids=where[None].expand(ids.shape[0], n), use_cache=True,
            )  # fmt: skip
            keys = torch.stack([layer.keys for layer in cache.layers])
            values = torch.stack([layer.values for layer in cache.layers])
            return out.logits[:, -1], keys, values

    step, _ = as_jax(Step())
    kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    shape = (cfg.num_hidden_layers, B, kv, GEN_CACHE, head)

    def generate(params, prompt):
        keys = values = jnp.zeros(shape, jnp.float32)
        logits, keys, values = step(params, prompt, jnp.asarray(0, jnp.int32), keys, values)
        out = jnp.zeros((prompt.shape[0], GEN_NEW), jnp.int32)

        def body(i, carry):
            tok, keys, values, out = carry
            out = out.at[:, i].set(tok)
            where = (prompt.shape[1] + i).astype(jnp.int32)
            logits, keys, values = step(params, tok[:, None], where, keys, values)
            return jnp.argmax(logits, -1).astype(jnp.int32), keys, values, out

        tok = jnp.argmax(logits, -1).astype(jnp.int32)
        return jax.lax.fori_loop(0, GEN_NEW, body, (tok, keys, values, out))[3]

    return generate


def causal_lm(cls_name, cfg_name, impl, **cfg):
    """A decoder LM: ``(ids, padding mask)`` -> logits; next-token loss;
    greedy decoding with a static KV cache where the model takes one."""

    def build():
        import jax

        config = _config(cfg_name, impl, **cfg)
        model = _model(cls_name, config)
        module = _wrap(model, lambda m, ids, mask: m(input_ids=ids, attention_mask=mask).logits)
        loss = lambda f: token_loss(f, targets_at=0, mask_at=1)  # noqa: E731
        notes = f"B={B}, row 1 right-padded by {PAD}; attn_implementation={impl}"
        built = _built(module, (_ids(), _mask()), loss, (T, T), notes)
        prompt = _ids(GEN_PROMPT, seed=2)
        try:
            config.use_cache = True
            generate = greedy(model)
            jax.eval_shape(generate, built.params, prompt)
        except Exception as err:
            built.notes += f"; no static-cache decoding through torchax ({type(err).__name__})"
        else:
            built.generate, built.generate_inputs = generate, (prompt,)
            built.notes += (
                f"; generate: prompt {GEN_PROMPT} + {GEN_NEW} greedy tokens, "
                f"static cache of {GEN_CACHE}"
            )
        finally:
            config.use_cache = False
        return built

    return build


def encoder(cls_name, cfg_name, impl, head="logits", **cfg):
    """An encoder: ``(ids, padding mask)`` -> MLM logits (token loss in place)
    or hidden states (square loss)."""

    def build():
        model = _model(cls_name, _config(cfg_name, impl, **cfg))
        module = _wrap(
            model, lambda m, ids, mask: getattr(m(input_ids=ids, attention_mask=mask), head)
        )
        if head == "logits":
            loss = lambda f: token_loss(f, targets_at=0, mask_at=1, shift=False)  # noqa: E731
        else:
            loss = sq_loss
        notes = f"B={B}, row 1 right-padded by {PAD}; attn_implementation={impl}"
        return _built(module, (_ids(), _mask()), loss, (T, T), notes)

    return build


def seq2seq(cls_name, cfg_name, impl, **cfg):
    """An encoder-decoder: ``(ids, padding mask, decoder ids)`` -> logits;
    next-token loss on the decoder ids."""

    def build():
        model = _model(cls_name, _config(cfg_name, impl, **cfg))

        def call(m, ids, mask, dec):
            return m(input_ids=ids, attention_mask=mask, decoder_input_ids=dec).logits

        module = _wrap(model, call)
        loss = lambda f: token_loss(f, targets_at=2)  # noqa: E731
        notes = (
            f"B={B}, encoder {T} tokens (row 1 right-padded by {PAD}), decoder {T_DEC}; "
            f"attn_implementation={impl}"
        )
        return _built(module, (_ids(), _mask(), _ids(T_DEC, seed=1)), loss, (T, T), notes)

    return build


def vision(cls_name, cfg_name, impl, head="last_hidden_state", size=IMAGE, seq=None, **cfg):
    """A vision encoder: ``(pixels,)`` -> hidden states; square loss."""

    def build():
        model = _model(cls_name, _config(cfg_name, impl, **cfg))
        module = _wrap(model, lambda m, x: getattr(m(pixel_values=x), head))
        n = seq or (size // PATCH) ** 2 + 1
        notes = f"B={B}, {size}x{size} images; attn_implementation={impl}"
        return _built(module, (_pixels(size),), sq_loss, (n, n), notes)

    return build


def dual(cls_name, cfg_name, impl, text, vision_cfg, **cfg):
    """CLIP-like: ``(ids, padding mask, pixels)`` -> image-text logits."""

    def build():
        model = _model(
            cls_name, _config(cfg_name, impl, text_config=text, vision_config=vision_cfg, **cfg)
        )

        def call(m, ids, mask, x):
            return m(input_ids=ids, attention_mask=mask, pixel_values=x).logits_per_image

        module = _wrap(model, call)
        notes = f"B={B}, text {T_DEC} tokens (row 1 right-padded by {PAD}), {IMAGE}x{IMAGE} images"
        notes += f"; attn_implementation={impl}"
        inputs = (_ids(T_DEC), _mask(T_DEC), _pixels())
        return _built(module, inputs, sq_loss, ((IMAGE // PATCH) ** 2 + 1,) * 2, notes)

    return build


def whisper(impl):
    """Whisper: ``(log-mel features, decoder ids)`` -> logits."""

    def build():
        cfg = dict(
            vocab_size=VOCAB, num_mel_bins=16, d_model=W, encoder_layers=LAYERS,
            decoder_layers=LAYERS, encoder_attention_heads=HEADS, decoder_attention_heads=HEADS,
            encoder_ffn_dim=2 * W, decoder_ffn_dim=2 * W, max_source_positions=T,
            max_target_positions=T_DEC, decoder_start_token_id=1, pad_token_id=0,
            bos_token_id=1, eos_token_id=2,
        )  # fmt: skip
        model = _model("WhisperForConditionalGeneration", _config("WhisperConfig", impl, **cfg))
        module = _wrap(model, lambda m, x, dec: m(input_features=x, decoder_input_ids=dec).logits)
        from ..weights import normal

        feats = normal((B, 16, 2 * T), seed=4)  # two conv strides: 512 frames -> 256 positions
        loss = lambda f: token_loss(f, targets_at=1)  # noqa: E731
        notes = (
            f"B={B}, 16 mel bins x {2 * T} frames ({T} encoder positions), decoder {T_DEC}; {impl}"
        )
        return _built(module, (feats, _ids(T_DEC, seed=1)), loss, (T, T), notes)

    return build


# --------------------------------------------------------------------------- configs

_GQA = dict(
    vocab_size=VOCAB, hidden_size=W, intermediate_size=2 * W, num_hidden_layers=LAYERS,
    num_attention_heads=HEADS, num_key_value_heads=KV, max_position_embeddings=2 * T,
)  # fmt: skip
_MHA = {k: v for k, v in _GQA.items() if k != "num_key_value_heads"}
# A fused gate-and-up projection is 2 * intermediate_size wide, an expert's
# per token and expert: at 2 * (2 * W) = T it could hold a T x T matrix by
# shape alone (tests/t_by_s.py), so those models take intermediate_size = W.
_GQA_FUSED_MLP = _GQA | {"intermediate_size": W}
_BERT = dict(
    vocab_size=VOCAB, hidden_size=W, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
    intermediate_size=2 * W, max_position_embeddings=T + 2,
)  # fmt: skip
_BART = dict(
    vocab_size=VOCAB, d_model=W, encoder_layers=LAYERS, decoder_layers=LAYERS,
    encoder_attention_heads=HEADS, decoder_attention_heads=HEADS, encoder_ffn_dim=2 * W,
    decoder_ffn_dim=2 * W, max_position_embeddings=T, pad_token_id=0, bos_token_id=1,
    eos_token_id=2, decoder_start_token_id=1,
)  # fmt: skip
_T5 = dict(
    vocab_size=VOCAB, d_model=W, d_kv=W // HEADS, d_ff=2 * W, num_layers=LAYERS,
    num_heads=HEADS, decoder_start_token_id=0,
)  # fmt: skip
_VIT = dict(
    hidden_size=W, num_hidden_layers=LAYERS, num_attention_heads=HEADS, intermediate_size=2 * W,
    image_size=IMAGE, patch_size=PATCH,
)  # fmt: skip

#: (name, family, builder of an impl, impls, sample). ``impls``: the
#: attn_implementations the model has (eager and sdpa where both).
_BOTH = ("eager", "sdpa")
_ENTRIES = [
    # decoder LMs
    ("GPT2LMHeadModel", "decoder", lambda i: causal_lm(
        "GPT2LMHeadModel", "GPT2Config", i, vocab_size=VOCAB, n_embd=W, n_layer=LAYERS,
        n_head=HEADS, n_positions=2 * T, n_inner=2 * W), _BOTH, True),
    ("GPTNeoForCausalLM", "decoder", lambda i: causal_lm(
        "GPTNeoForCausalLM", "GPTNeoConfig", i, vocab_size=VOCAB, hidden_size=W,
        num_layers=LAYERS, num_heads=HEADS, attention_types=[[["global", "local"], 1]],
        window_size=64, max_position_embeddings=2 * T, intermediate_size=2 * W), ("eager",), False),
    ("GPTNeoXForCausalLM", "decoder", lambda i: causal_lm(
        "GPTNeoXForCausalLM", "GPTNeoXConfig", i, **_MHA), _BOTH, False),
    ("GPTJForCausalLM", "decoder", lambda i: causal_lm(
        "GPTJForCausalLM", "GPTJConfig", i, vocab_size=VOCAB, n_embd=W, n_layer=LAYERS,
        n_head=HEADS, rotary_dim=8, n_positions=2 * T, n_inner=2 * W), _BOTH, False),
    ("GPTBigCodeForCausalLM", "decoder", lambda i: causal_lm(
        "GPTBigCodeForCausalLM", "GPTBigCodeConfig", i, vocab_size=VOCAB, n_embd=W,
        n_layer=LAYERS, n_head=HEADS, n_positions=2 * T, multi_query=True, n_inner=2 * W),
        _BOTH, False),
    ("CodeGenForCausalLM", "decoder", lambda i: causal_lm(
        "CodeGenForCausalLM", "CodeGenConfig", i, vocab_size=VOCAB, n_embd=W, n_layer=LAYERS,
        n_head=HEADS, rotary_dim=8, n_positions=2 * T, n_ctx=2 * T, n_inner=2 * W),
        ("eager",), False),
    ("OPTForCausalLM", "decoder", lambda i: causal_lm(
        "OPTForCausalLM", "OPTConfig", i, vocab_size=VOCAB, hidden_size=W,
        num_hidden_layers=LAYERS, ffn_dim=2 * W, num_attention_heads=HEADS,
        max_position_embeddings=2 * T, word_embed_proj_dim=W), _BOTH, False),
    ("BloomForCausalLM", "decoder", lambda i: causal_lm(
        "BloomForCausalLM", "BloomConfig", i, vocab_size=VOCAB, hidden_size=48, n_layer=LAYERS,
        n_head=HEADS), ("eager",), False),
    ("FalconForCausalLM", "decoder", lambda i: causal_lm(
        "FalconForCausalLM", "FalconConfig", i, vocab_size=VOCAB, hidden_size=W,
        num_hidden_layers=LAYERS, num_attention_heads=HEADS, new_decoder_architecture=True,
        num_kv_heads=KV, max_position_embeddings=2 * T, ffn_hidden_size=2 * W), _BOTH, False),
    ("XGLMForCausalLM", "decoder", lambda i: causal_lm(
        "XGLMForCausalLM", "XGLMConfig", i, vocab_size=VOCAB, d_model=W, num_layers=LAYERS,
        attention_heads=HEADS, ffn_dim=2 * W, max_position_embeddings=2 * T), ("eager",), False),
    ("BioGptForCausalLM", "decoder", lambda i: causal_lm(
        "BioGptForCausalLM", "BioGptConfig", i, **_MHA), _BOTH, False),
    ("LlamaForCausalLM", "decoder", lambda i: causal_lm(
        "LlamaForCausalLM", "LlamaConfig", i, **_GQA), _BOTH, True),
    ("MistralForCausalLM", "decoder", lambda i: causal_lm(
        "MistralForCausalLM", "MistralConfig", i, sliding_window=None, **_GQA), _BOTH, False),
    ("MixtralForCausalLM", "decoder", lambda i: causal_lm(
        "MixtralForCausalLM", "MixtralConfig", i, sliding_window=None, num_local_experts=4,
        num_experts_per_tok=2, experts_implementation="batched_mm", **_GQA_FUSED_MLP), _BOTH,
        False),
    ("Qwen2ForCausalLM", "decoder", lambda i: causal_lm(
        "Qwen2ForCausalLM", "Qwen2Config", i, **_GQA), _BOTH, False),
    ("Qwen3ForCausalLM", "decoder", lambda i: causal_lm(
        "Qwen3ForCausalLM", "Qwen3Config", i, head_dim=W // HEADS, **_GQA), _BOTH, False),
    ("Qwen2MoeForCausalLM", "decoder", lambda i: causal_lm(
        "Qwen2MoeForCausalLM", "Qwen2MoeConfig", i, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=W, shared_expert_intermediate_size=W,
        experts_implementation="batched_mm", **_GQA), _BOTH, False),
    ("PhiForCausalLM", "decoder", lambda i: causal_lm(
        "PhiForCausalLM", "PhiConfig", i, **_MHA), _BOTH, False),
    ("Phi3ForCausalLM", "decoder", lambda i: causal_lm(
        "Phi3ForCausalLM", "Phi3Config", i, pad_token_id=0, **_GQA_FUSED_MLP), _BOTH, False),
    ("GemmaForCausalLM", "decoder", lambda i: causal_lm(
        "GemmaForCausalLM", "GemmaConfig", i, head_dim=W // HEADS, **_GQA), _BOTH, False),
    ("Gemma2ForCausalLM", "decoder", lambda i: causal_lm(
        "Gemma2ForCausalLM", "Gemma2Config", i, head_dim=W // HEADS, sliding_window=64,
        **_GQA), ("eager",), False),
    ("Gemma3ForCausalLM", "decoder", lambda i: causal_lm(
        "Gemma3ForCausalLM", "Gemma3TextConfig", i, head_dim=W // HEADS, sliding_window=64,
        layer_types=["sliding_attention", "full_attention"], **_GQA), _BOTH, False),
    ("StableLmForCausalLM", "decoder", lambda i: causal_lm(
        "StableLmForCausalLM", "StableLmConfig", i, **_GQA), _BOTH, False),
    ("Starcoder2ForCausalLM", "decoder", lambda i: causal_lm(
        "Starcoder2ForCausalLM", "Starcoder2Config", i, sliding_window=None, **_GQA), _BOTH, False),
    ("OlmoForCausalLM", "decoder", lambda i: causal_lm(
        "OlmoForCausalLM", "OlmoConfig", i, **_GQA), _BOTH, False),
    ("Olmo2ForCausalLM", "decoder", lambda i: causal_lm(
        "Olmo2ForCausalLM", "Olmo2Config", i, **_GQA), _BOTH, False),
    ("CohereForCausalLM", "decoder", lambda i: causal_lm(
        "CohereForCausalLM", "CohereConfig", i, **_GQA), _BOTH, False),
    ("GraniteForCausalLM", "decoder", lambda i: causal_lm(
        "GraniteForCausalLM", "GraniteConfig", i, **_GQA), _BOTH, False),
    # encoders
    ("BertForMaskedLM", "encoder", lambda i: encoder(
        "BertForMaskedLM", "BertConfig", i, **_BERT), _BOTH, True),
    ("RobertaForMaskedLM", "encoder", lambda i: encoder(
        "RobertaForMaskedLM", "RobertaConfig", i, pad_token_id=1, **_BERT), _BOTH, False),
    ("XLMRobertaForMaskedLM", "encoder", lambda i: encoder(
        "XLMRobertaForMaskedLM", "XLMRobertaConfig", i, pad_token_id=1, **_BERT), _BOTH, False),
    ("CamembertForMaskedLM", "encoder", lambda i: encoder(
        "CamembertForMaskedLM", "CamembertConfig", i, pad_token_id=1, **_BERT), _BOTH, False),
    ("ElectraForMaskedLM", "encoder", lambda i: encoder(
        "ElectraForMaskedLM", "ElectraConfig", i, embedding_size=W, **_BERT), _BOTH, False),
    ("AlbertForMaskedLM", "encoder", lambda i: encoder(
        "AlbertForMaskedLM", "AlbertConfig", i, embedding_size=32, **_BERT), _BOTH, False),
    ("DistilBertForMaskedLM", "encoder", lambda i: encoder(
        "DistilBertForMaskedLM", "DistilBertConfig", i, vocab_size=VOCAB, dim=W,
        n_layers=LAYERS, n_heads=HEADS, hidden_dim=2 * W, max_position_embeddings=T), _BOTH, False),
    ("MPNetForMaskedLM", "encoder", lambda i: encoder(
        "MPNetForMaskedLM", "MPNetConfig", i, pad_token_id=1, **_BERT), ("eager",), False),
    ("DebertaForMaskedLM", "encoder", lambda i: encoder(
        "DebertaForMaskedLM", "DebertaConfig", i, relative_attention=True,
        pos_att_type=["c2p", "p2c"], max_relative_positions=T, **_BERT), ("eager",), False),
    ("DebertaV2ForMaskedLM", "encoder", lambda i: encoder(
        "DebertaV2ForMaskedLM", "DebertaV2Config", i, relative_attention=True,
        pos_att_type=["c2p", "p2c"], position_buckets=32, max_relative_positions=T,
        **_BERT), ("eager",), False),
    ("RoFormerForMaskedLM", "encoder", lambda i: encoder(
        "RoFormerForMaskedLM", "RoFormerConfig", i, embedding_size=W, **_BERT), ("eager",), False),
    ("ErnieForMaskedLM", "encoder", lambda i: encoder(
        "ErnieForMaskedLM", "ErnieConfig", i, **_BERT), _BOTH, False),
    ("ModernBertForMaskedLM", "encoder", lambda i: encoder(
        "ModernBertForMaskedLM", "ModernBertConfig", i, local_attention=64,
        global_attn_every_n_layers=2, pad_token_id=0, **_BERT), _BOTH, False),
    # encoder-decoders
    ("T5ForConditionalGeneration", "encoder-decoder", lambda i: seq2seq(
        "T5ForConditionalGeneration", "T5Config", i, **_T5), ("eager",), True),
    ("MT5ForConditionalGeneration", "encoder-decoder", lambda i: seq2seq(
        "MT5ForConditionalGeneration", "MT5Config", i, **_T5), ("eager",), False),
    ("BartForConditionalGeneration", "encoder-decoder", lambda i: seq2seq(
        "BartForConditionalGeneration", "BartConfig", i, **_BART), _BOTH, False),
    ("MBartForConditionalGeneration", "encoder-decoder", lambda i: seq2seq(
        "MBartForConditionalGeneration", "MBartConfig", i, **_BART), _BOTH, False),
    ("PegasusForConditionalGeneration", "encoder-decoder", lambda i: seq2seq(
        "PegasusForConditionalGeneration", "PegasusConfig", i, **_BART), _BOTH, False),
    ("MarianMTModel", "encoder-decoder", lambda i: seq2seq(
        "MarianMTModel", "MarianConfig", i, decoder_vocab_size=VOCAB, **_BART), _BOTH, False),
    ("WhisperForConditionalGeneration", "speech", whisper, _BOTH, True),
    # vision
    ("ViTModel", "vision", lambda i: vision("ViTModel", "ViTConfig", i, **_VIT), _BOTH, True),
    ("DeiTModel", "vision", lambda i: vision(
        "DeiTModel", "DeiTConfig", i, seq=(IMAGE // PATCH) ** 2 + 2, **_VIT), _BOTH, False),
    ("BeitModel", "vision", lambda i: vision(
        "BeitModel", "BeitConfig", i, use_relative_position_bias=True, **_VIT), _BOTH, False),
    ("Dinov2Model", "vision", lambda i: vision(
        "Dinov2Model", "Dinov2Config", i, **_VIT), _BOTH, False),
    ("CLIPVisionModel", "vision", lambda i: vision(
        "CLIPVisionModel", "CLIPVisionConfig", i, **_VIT), _BOTH, False),
    ("SiglipVisionModel", "vision", lambda i: vision(
        "SiglipVisionModel", "SiglipVisionConfig", i, seq=(IMAGE // PATCH) ** 2, **_VIT),
        _BOTH, False),
    ("SwinModel", "vision", lambda i: vision(
        "SwinModel", "SwinConfig", i, image_size=IMAGE, patch_size=2, embed_dim=32,
        depths=[1, 1], num_heads=[2, 4], window_size=8, seq=64), _BOTH, False),
    ("CLIPModel", "multimodal", lambda i: dual(
        "CLIPModel", "CLIPConfig", i,
        dict(vocab_size=VOCAB, hidden_size=W, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
             intermediate_size=2 * W, max_position_embeddings=T_DEC),
        dict(_VIT)), _BOTH, True),
    ("SiglipModel", "multimodal", lambda i: dual(
        "SiglipModel", "SiglipConfig", i,
        dict(vocab_size=VOCAB, hidden_size=W, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
             intermediate_size=2 * W, max_position_embeddings=T_DEC),
        dict(_VIT)), _BOTH, False),
]  # fmt: skip

_NO_GENERATE = ("direct", "jit", "train", "export")
_LM = ("direct", "jit", "train", "generate", "export")

MODELS = [
    ZooModel(
        SUITE,
        f"{name}[{impl}]",
        family,
        make(impl),
        modes=_LM if family == "decoder" else _NO_GENERATE,
        sample=sample and impl == impls[0],
    )
    for name, family, make, impls, sample in _ENTRIES
    for impl in impls
]
