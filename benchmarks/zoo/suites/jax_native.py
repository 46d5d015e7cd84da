"""JAX-native attention: Flax linen and NNX, Equinox, Haiku, penzai, jax.nn, and the
MaxText-style stacks of the model tests.

Each model is one library layer (self-attention, causal, padded, cross) or a
small stack, at 256 tokens (cross-attention: 128 queries over 256 keys), with
random weights.  The MaxText-style decoders are the model tests' own
functions (``tests/models/test_maxtext_style.py``), fed a packed batch of
256 tokens.  None of these libraries' layers comes with a KV-cache
generation loop that is a plain function, so generation is not swept here.
"""

from __future__ import annotations

import functools

from ..model import Built, ZooModel

SUITE = "jax_native"
B, T, T_Q, D, HEADS, VOCAB = 2, 256, 128, 32, 4, 64
MODES = ("direct", "jit", "train")


def _x(seed=0, t=T):
    from .. import weights as w

    return w.normal((B, t, D), seed)


def _lengths_mask(t=T, kept=T - 56):
    """``[B, 1, 1, t]`` key mask: row 1 keeps its first ``kept`` keys."""
    from .. import weights as w

    return w.padding(B, t, kept).astype(bool)[:, None, None, :]


def _loss(forward):
    import jax
    import jax.numpy as jnp

    def loss(params, *inputs):
        return sum(
            jnp.mean(jnp.square(y)) for y in jax.tree_util.tree_leaves(forward(params, *inputs))
        )

    return loss


def _built(forward, params, inputs, seq=(T, T), notes=""):
    return Built(
        forward, params, inputs, loss=_loss(forward), seq=seq, notes=notes or f"B={B}, d_model {D}"
    )


# --------------------------------------------------------------------------- flax


def _linen(kind):
    def build():
        import flax.linen as nn
        import jax

        from .. import weights as w

        mha = nn.MultiHeadDotProductAttention(num_heads=HEADS, qkv_features=D)
        x = _x()
        if kind == "cross":
            xq = _x(1, T_Q)
            mask = _lengths_mask()
            params = w.random_params(mha.init, jax.random.PRNGKey(0), xq, x, mask=mask)
            return _built(
                lambda p, q, kv, m: mha.apply(p, q, kv, mask=m), params, (xq, x, mask), (T_Q, T)
            )
        params = w.random_params(mha.init, jax.random.PRNGKey(0), x)
        if kind == "causal":  # built inside, as a model does: its structure is in the program

            def causal(p, x):
                return mha.apply(p, x, mask=nn.make_causal_mask(x[..., 0]))

            return _built(causal, params, (x,))
        if kind == "padding":
            mask = _lengths_mask()
            return _built(lambda p, x, m: mha.apply(p, x, mask=m), params, (x, mask))
        return _built(lambda p, x: mha.apply(p, x), params, (x,))

    return build


def _linen_scan_stack():
    def build():
        import flax.linen as nn
        import jax

        from .. import weights as w

        class Block(nn.Module):
            @nn.compact
            def __call__(self, x, _):
                y = nn.MultiHeadDotProductAttention(num_heads=HEADS, qkv_features=D)(
                    nn.LayerNorm()(x), mask=nn.make_causal_mask(x[..., 0])
                )
                return x + nn.Dense(D)(nn.gelu(nn.Dense(2 * D)(x + y))), None

        class Stack(nn.Module):
            @nn.compact
            def __call__(self, x):
                body = nn.remat(Block)
                scan = nn.scan(
                    body, variable_axes={"params": 0}, split_rngs={"params": True}, length=2
                )
                return scan()(x, None)[0]

        model = Stack()
        x = _x()
        params = w.random_params(model.init, jax.random.PRNGKey(0), x)
        return _built(model.apply, params, (x,), notes="2 causal layers under nn.scan + nn.remat")

    return build


def _nnx(kind):
    def build():
        import flax.nnx as nnx

        mha = nnx.MultiHeadAttention(num_heads=HEADS, in_features=D, decode=False, rngs=nnx.Rngs(0))
        graphdef, state = nnx.split(mha)
        x = _x()
        if kind == "causal":

            def causal(st, x):
                return nnx.merge(graphdef, st)(x, mask=nnx.make_causal_mask(x[..., 0]))

            return _built(causal, state, (x,))
        return _built(lambda st, x: nnx.merge(graphdef, st)(x), state, (x,))

    return build


# --------------------------------------------------------------------------- equinox, haiku


def _equinox(kind):
    def build():
        import equinox as eqx
        import jax
        import jax.numpy as jnp

        mha = eqx.nn.MultiheadAttention(num_heads=HEADS, query_size=D, key=jax.random.PRNGKey(0))
        params, static = eqx.partition(mha, eqx.is_inexact_array)
        x = _x()
        if kind == "causal":
            mask = jnp.tril(jnp.ones((T, T), bool))

            def fn(params, x):
                m = eqx.combine(params, static)
                return jax.vmap(lambda x: m(x, x, x, mask=mask))(x)

        else:

            def fn(params, x):
                m = eqx.combine(params, static)
                return jax.vmap(lambda x: m(x, x, x))(x)

        return _built(fn, params, (x,), notes=f"B={B} by vmap, d_model {D}")

    return build


def _haiku(kind):
    def build():
        import haiku as hk
        import jax
        import jax.numpy as jnp

        from .. import weights as w

        def forward(x, *mask):
            if kind == "causal":  # built inside, as a model does
                mask = (jnp.tril(jnp.ones((1, 1, x.shape[1], x.shape[1]), bool)),)
            mha = hk.MultiHeadAttention(
                num_heads=HEADS, key_size=D // HEADS, w_init=hk.initializers.VarianceScaling(1.0)
            )
            return mha(x, x, x, mask=mask[0] if mask else None)

        model = hk.without_apply_rng(hk.transform(forward))
        x = _x()
        extra = ()
        if kind == "padding":
            extra = (_lengths_mask(),)
        params = w.random_params(model.init, jax.random.PRNGKey(0), x, *extra)
        return _built(model.apply, params, (x, *extra))

    return build


# --------------------------------------------------------------------------- jax.nn


def _jax_nn(kind):
    def build():
        import jax

        from .. import weights as w

        kv_heads = 2 if kind == "gqa" else HEADS
        q = w.normal((B, T, HEADS, 8), 0)
        k = w.normal((B, T, kv_heads, 8), 1)
        v = w.normal((B, T, kv_heads, 8), 2)
        opts = {"is_causal": kind in ("causal", "gqa")}

        def fn(params, q, k, v):
            return jax.nn.dot_product_attention(q * params, k, v, implementation="xla", **opts)

        import jax.numpy as jnp

        return _built(fn, jnp.ones(()), (q, k, v), notes=f"B={B}, {HEADS} heads of 8")

    return build


# --------------------------------------------------------------------------- penzai


def _penzai(variant):
    def build():
        import jax
        import jax.numpy as jnp
        from penzai import pz

        if variant == "gpt_neox":
            from penzai.models.transformer.variants import gpt_neox

            cfg = gpt_neox.GPTNeoXTransformerConfig(
                num_attention_heads=2, embedding_dim=16, projection_dim=8, mlp_hidden_dim=32,
                num_decoder_blocks=2, vocab_size=VOCAB, activation_fn="gelu_exact",
                rope_subset_size=4,
                rope_wavelength=10_000, layernorm_epsilon=1e-5, parameter_dtype=jnp.float32,
                activation_dtype=jnp.float32, use_layer_stack=False,
            )  # fmt: skip
            model = gpt_neox.build_gpt_neox_transformer(cfg, init_base_rng=jax.random.key(0))
        else:
            from penzai.models.transformer.variants import llamalike_common as ll

            extra = {}
            if variant == "gemma2":
                window = ll.AttentionTypeSlidingWindowCausal(64)
                extra = dict(
                    attention_type=(window, ll.AttentionTypeGlobalCausal()),
                    use_post_attn_norm=True, use_post_ffw_norm=True, final_logit_softcap=30.0,
                    attn_logits_soft_cap=50.0,
                )  # fmt: skip
            cfg = ll.LlamalikeTransformerConfig(
                num_kv_heads=2, query_head_multiplier=2, embedding_dim=16, projection_dim=4,
                mlp_hidden_dim=32, num_decoder_blocks=2, vocab_size=VOCAB,
                mlp_variant="geglu_approx", tie_embedder_and_logits=False,
                rope_wavelength=10_000, use_layer_stack=False, **extra,
            )  # fmt: skip
            model = ll.build_llamalike_transformer(cfg, init_base_rng=jax.random.key(0))
        unbound, params = pz.unbind_params(model)
        tokens = jnp.arange(B * T, dtype=jnp.int32).reshape(B, T) % VOCAB

        def fn(params, tokens):
            out = pz.bind_variables(unbound, params)(pz.nx.wrap(tokens).tag("batch", "seq"))
            return out.unwrap("batch", "seq", "vocabulary")

        return _built(fn, [p.freeze() for p in params], (tokens,))

    return build


# --------------------------------------------------------------------------- MaxText-style


def _load(name, path):
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@functools.cache
def _maxtext_style():
    """The model tests' MaxText-style module, loaded by path (it is a test
    module beside its conftest, not a package)."""
    import pathlib
    import sys

    models = pathlib.Path(__file__).resolve().parents[3] / "tests" / "models"
    if str(models.parent) not in sys.path:  # its conftest imports helpers from tests/
        sys.path.insert(0, str(models.parent))
    # It imports its tolerances from ``conftest``: the models' one, by path,
    # stands in under that name while the module loads.
    conftest = _load("_zoo_models_conftest", models / "conftest.py")
    saved = sys.modules.get("conftest")
    sys.modules["conftest"] = conftest
    try:
        module = _load("_zoo_maxtext_style", models / "test_maxtext_style.py")
    finally:
        if saved is None:
            sys.modules.pop("conftest", None)
        else:
            sys.modules["conftest"] = saved
    return module


def _packed(t=T):
    """Row 0: three documents; row 1: two documents and right padding (segment 0)."""
    import jax.numpy as jnp
    import numpy as np

    lengths = [[n * t // T for n in row] for row in ([100, 90, 66], [150, 60, 0])]
    ids, pos = np.zeros((B, t), np.int32), np.zeros((B, t), np.int32)
    for row, docs in enumerate(lengths):
        start = 0
        for seg, n in enumerate(docs, start=1):
            ids[row, start : start + n] = seg
            pos[row, start : start + n] = np.arange(n)
            start += n
    tokens = np.random.default_rng(7).integers(0, 64, (B, t)).astype(np.int32)
    return jnp.asarray(tokens), jnp.asarray(ids), jnp.asarray(pos)


def _maxtext(kind, t=T):
    def build():
        mt = _maxtext_style()
        if kind == "gemma2":
            fn, params = mt.gemma2_decoder(verbatim=True), mt._gemma2_params()
        elif kind == "moe":
            fn, params = mt.decoder(verbatim=True), mt._params(2, experts=4)
        else:
            fn, params = mt.decoder(verbatim=True), mt._params(2)
        return _built(fn, params, _packed(t), (t, t), notes=f"B={B}, packed documents, 2 layers")

    return build


def _m(name, family, build, sample=False, modes=MODES, **kw):
    return ZooModel(SUITE, name, family, build, modes=modes, sample=sample, **kw)


MODELS = [
    _m("flax.linen MHA self", "flax", _linen("self"), True),
    _m("flax.linen MHA causal", "flax", _linen("causal")),
    _m("flax.linen MHA padding", "flax", _linen("padding")),
    _m("flax.linen MHA cross", "flax", _linen("cross")),
    _m("flax.linen scan+remat stack", "flax", _linen_scan_stack()),
    _m("flax.nnx MHA self", "flax", _nnx("self")),
    _m("flax.nnx MHA causal", "flax", _nnx("causal")),
    _m("equinox MHA self", "equinox", _equinox("self"), True),
    _m("equinox MHA causal", "equinox", _equinox("causal")),
    _m("haiku MHA self", "haiku", _haiku("self")),
    _m("haiku MHA causal", "haiku", _haiku("causal"), True),
    _m("haiku MHA padding", "haiku", _haiku("padding")),
    _m("jax.nn dot_product_attention", "jax.nn", _jax_nn("self"), True),
    _m("jax.nn dot_product_attention causal GQA", "jax.nn", _jax_nn("gqa")),
    _m("penzai Llama-like", "penzai", _penzai("llama"), True),
    _m("penzai Gemma 2-like", "penzai", _penzai("gemma2")),
    _m("penzai GPT-NeoX", "penzai", _penzai("gpt_neox")),
    _m("MaxText-style decoder (packed)", "maxtext", _maxtext("llama"), True),
    _m("MaxText-style MoE decoder", "maxtext", _maxtext("moe")),
    _m("MaxText-style Gemma 2 (scan, remat)", "maxtext", _maxtext("gemma2")),
    _m(
        "MaxText-style decoder (T=1024, default kernels)",
        "maxtext",
        _maxtext("llama", 1024),
        kernel=None,
        modes=("direct", "train"),
    ),
]
