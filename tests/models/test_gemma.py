"""DeepMind's ``gemma`` package (``gemma.gm.nn.Transformer``, the Flax
reference Gemma): Gemma 2 and Gemma 3 from tiny configs, random weights.

Both alternate a local sliding-window layer and a global one; Gemma 2 soft-caps
the attention logits (and the final logits), Gemma 3 normalises q and k (QK-norm)
and gives local and global layers their own RoPE frequencies.  Grouped-query
heads are a 5-D einsum whose logits are reshaped to ``[b, t, n, s]`` and back
around the softmax; the mask (the token mask, causal, and the sliding window of
``segment_pos``) is a boolean ``where`` with ``K_MASK``.  Parameters are
float32 (``dtype=``; the default is bfloat16).

``gemma`` is not in the ``models`` extra: ``pip install gemma==3.3.0`` on
constraints.txt keeps JAX and Flax but adds about 150 packages (3.4 GB, with
TensorFlow 2.21, which ``kauldron.typing`` imports) and downgrades protobuf to
6.x (kauldron -> xmanager requires ``protobuf<7``), after which ``gemma.gm.nn``
fails to import (sentencepiece 0.2.3's generated code needs protobuf >= 7.36).
The module is skipped where ``gemma.gm.nn`` does not import.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

try:
    from gemma.gm.nn import _config, _modules, _transformer
except Exception as error:  # ImportError, or protobuf's VersionError (see above)
    pytest.skip(f"gemma.gm.nn does not import: {error!r}"[:200], allow_module_level=True)

WHERE = "gemma/gm/nn/_modules.py"
B, T, VOCAB = 2, 12, 64
WINDOW = 4  # shorter than T: the local layer's window excludes keys
LOCAL, GLOBAL = _modules.AttentionType.LOCAL_SLIDING, _modules.AttentionType.GLOBAL

COMMON = dict(
    num_embed=VOCAB,
    embed_dim=32,
    hidden_dim=64,
    num_heads=4,
    head_dim=8,
    num_kv_heads=2,
    use_post_attn_norm=True,
    use_post_ffw_norm=True,
    sliding_window_size=WINDOW,
    attention_types=(LOCAL, GLOBAL),
)
CONFIGS = {
    "gemma2": lambda: _config.TransformerConfig(
        **COMMON, final_logit_softcap=30.0, attn_logits_soft_cap=50.0
    ),
    "gemma3": lambda: _config.TransformerConfig(
        **COMMON,
        final_logit_softcap=None,
        use_qk_norm=True,
        local_base_frequency=10_000,
        global_base_frequency=1_000_000,
    ),
}


def _model(name, random_params):
    model = _transformer.Transformer(config=CONFIGS[name](), dtype=jnp.float32)
    tokens = np.arange(B * T).reshape(B, T) % (VOCAB - 1) + 1
    tokens[1, 9:] = 0  # right padding: the token mask excludes it
    tokens = jnp.asarray(tokens, jnp.int32)
    params = random_params(model.init, jax.random.key(0), tokens)

    def fn(params, tokens):
        return model.apply(params, tokens).logits

    return fn, params, tokens


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_transformer(check_model, random_params, name):
    fn, params, tokens = _model(name, random_params)
    report = check_model(
        fn,
        params,
        tokens,
        library="gemma",
        case=f"{name} Transformer (local + global, GQA)",
        sites=2,
        where=WHERE,
    )
    ops = [[op["op"] for op in r.spec["score_ops"]] for r in report.rewrites]
    if name == "gemma2":
        assert all(o[0] == "softcap" for o in ops), ops
    else:
        assert not any("softcap" in o for o in ops), ops
    assert all(r.q_shape == (B, T, 2, 2, 8) for r in report.rewrites)
