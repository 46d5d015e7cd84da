"""Library models exported with `jax.export` and rewritten on both routes:
flax.linen's MultiHeadDotProductAttention, Hugging Face Flax GPT-2 and BERT,
keras-hub backbones through ``stateless_call`` (tiny configs, random weights,
nothing downloaded).  Value and gradient (``vjp_order=1``) equal the original
artifact's; the compiled rewritten artifact holds no T×S array that
`flashpass.optimize` of the same JAX function does not (the export tier adds
none), and none at all where the matcher folds the mask to O(T) data (BERT)."""

from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from txs import txs_shapes  # noqa: E402

import flashpass  # noqa: E402
import flashpass.export as fx  # noqa: E402
from flashpass.kernels.blockwise import BlockwiseKernel  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

B, T, VOCAB = 2, 24, 128
KERNEL = BlockwiseKernel(block_q=8, block_k=8)  # tiles smaller than T
KEEP = jnp.asarray(np.arange(T)[None, :] < np.array([T, 17])[:, None], jnp.int32)
IDS = jnp.asarray(np.random.default_rng(0).integers(0, VOCAB, (B, T)), jnp.int32)


def _flax_mha():
    nn = pytest.importorskip("flax.linen")
    m = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=16)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((B, T, 16)), jnp.float32)
    params = m.init(jax.random.PRNGKey(0), x)

    def fn(params, x, keep):
        return m.apply(params, x, mask=nn.make_attention_mask(keep, keep))

    return fn, (params, x, KEEP), 1


def _hf(name):
    tr = pytest.importorskip("transformers")
    pytest.importorskip("flax")
    if not hasattr(tr, "FlaxGPT2Model"):  # pragma: no cover - transformers >= 5
        pytest.skip("this transformers has no Flax models")
    if name == "gpt2":
        config = tr.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=64, vocab_size=VOCAB)
        model = tr.FlaxGPT2Model(config, _do_init=False)
    else:
        config = tr.BertConfig(
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            vocab_size=VOCAB,
            max_position_embeddings=64,
        )
        model = tr.FlaxBertModel(config, _do_init=False)
    params = model.init_weights(jax.random.PRNGKey(0), model.input_shape)

    def fn(params, ids, keep):
        return model(ids, attention_mask=keep, params=params).last_hidden_state

    return fn, (params, IDS, KEEP), 2


def _keras_hub(name):
    keras_hub = pytest.importorskip("keras_hub")
    m = keras_hub.models
    common = dict(vocabulary_size=VOCAB, num_layers=1, intermediate_dim=32)
    backbone = {
        "gpt2": lambda: m.GPT2Backbone(
            **common, num_heads=2, hidden_dim=16, max_sequence_length=32
        ),
        "llama": lambda: m.LlamaBackbone(
            **common, num_query_heads=4, num_key_value_heads=2, hidden_dim=16
        ),
    }[name]()
    rng = np.random.default_rng(0)
    params = [
        jnp.asarray(rng.standard_normal(v.shape) / np.sqrt(v.shape[0]), jnp.float32)
        if len(v.shape) >= 2
        else jnp.asarray(1.0 + 0.1 * rng.standard_normal(v.shape), jnp.float32)
        for v in backbone.trainable_variables
    ]
    state = [v.value for v in backbone.non_trainable_variables]

    def fn(params, ids, keep):
        inputs = {"token_ids": ids, "padding_mask": keep.astype(bool)}
        out, _ = backbone.stateless_call(params, state, inputs, training=False)
        return out["sequence_output"] if isinstance(out, dict) else out

    return fn, (params, IDS, KEEP), 1


MODELS = {
    "flax_mha": _flax_mha,
    "hf_gpt2": lambda: _hf("gpt2"),
    "hf_bert": lambda: _hf("bert"),
    "keras_hub_gpt2": lambda: _keras_hub("gpt2"),
    "keras_hub_llama": lambda: _keras_hub("llama"),
}
#: The mask folds to O(T) data: no T×S array at all in the compiled artifact.
NO_TXS = {"hf_bert"}


def _structs(tree):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a), jnp.asarray(a).dtype), tree)


def _compiled_txs(fn, args):
    return txs_shapes(jax.jit(fn).lower(*args).compile().as_text(), T, T)


#: BERT's exact GELU: `jax.export` expands ``erfc`` into a rational
#: approximation whose untaken ``select`` branch divides by x²; differentiated
#: op by op its gradient was NaN (0 · inf).  The lifter identifies the expansion
#: as ``erfc`` and gives it erfc's derivative (`flashpass.export.expansions`),
#: so the gradients below equal the original program's.


def _param(name):
    if name == "flax_mha":
        return name
    return pytest.param(name, marks=pytest.mark.slow)


@pytest.mark.parametrize("route", ["lift", "splice"])
@pytest.mark.parametrize("name", [_param(n) for n in MODELS])
def test_library_model_exported_and_rewritten(name, route):
    fn, args, sites = MODELS[name]()
    exp = jax.export.export(jax.jit(fn))(*_structs(args))
    new, report = fx.rewrite_and_explain(exp, route=route, kernel=KERNEL)
    assert report.route == route and len(report.rewrites) == sites, str(report)
    assert not report.fallbacks and not report.islands, str(report)
    new = jax.export.deserialize(new.serialize(vjp_order=1))
    np.testing.assert_allclose(jax.jit(new.call)(*args), exp.call(*args), atol=2e-5, rtol=0)

    left = _compiled_txs(new.call, args)
    direct = _compiled_txs(flashpass.optimize(fn, kernel=KERNEL), args)
    assert left <= direct, f"the export tier adds T×S arrays: {left - direct}"
    if name in NO_TXS:
        assert not left, left
    if name == "flax_mha":
        return  # the gradient: the slow models below, and the spellings' tests

    def loss(call):
        return jax.grad(lambda p: jnp.sum(call(p, *args[1:]) ** 2))

    got, want = loss(new.call)(args[0]), loss(exp.call)(args[0])
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, atol=1e-4, rtol=1e-3)
