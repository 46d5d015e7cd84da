"""penzai's llama-like transformer (``penzai.models.transformer``), random init
from a tiny config, its parameters unbound and passed in as frozen values so the
forward pass is a pure function of them.

Penzai's named-axis arrays copy the probabilities before ``P·V`` (a ``copy``
equation), and its grouped-query heads are a 5-D einsum.  Under a layer stack
(``use_layer_stack=True``) the masked-out fill is a per-layer value sliced by
the ``scan``: a traced scalar the matcher cannot yet prove excluding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

pz = pytest.importorskip("penzai.pz")
llamalike_common = pytest.importorskip("penzai.models.transformer.variants.llamalike_common")

WHERE = "penzai/"


def _forward(layer_stack: bool):
    cfg = llamalike_common.LlamalikeTransformerConfig(
        num_kv_heads=2,
        query_head_multiplier=2,
        embedding_dim=16,
        projection_dim=4,
        mlp_hidden_dim=32,
        num_decoder_blocks=2,
        vocab_size=32,
        mlp_variant="geglu_approx",
        tie_embedder_and_logits=False,
        rope_wavelength=10_000,
        use_layer_stack=layer_stack,
    )
    model = llamalike_common.build_llamalike_transformer(cfg, init_base_rng=jax.random.key(0))
    unbound, params = pz.unbind_params(model)
    tokens = pz.nx.wrap(jnp.arange(16, dtype=jnp.int32).reshape(2, 8) % 32).tag("batch", "seq")

    def fn(params, tokens):
        out = pz.bind_variables(unbound, params)(tokens)
        return out.unwrap("batch", "seq", "vocabulary")

    return fn, [p.freeze() for p in params], tokens


def test_llamalike(check_model):
    fn, params, tokens = _forward(layer_stack=False)
    check_model(
        fn,
        params,
        tokens,
        library="penzai",
        case="llamalike (GQA, 2 blocks)",
        sites=2,
        where=WHERE,
    )


@pytest.mark.slow
def test_llamalike_layer_stack(check_model):
    # The layer stack's per-layer masked_out_value is sliced by the scan: a slice of a
    # uniform stacked operand is the same scalar fill (`Scope.sliced`).
    fn, params, tokens = _forward(layer_stack=True)
    check_model(
        fn, params, tokens, library="penzai", case="llamalike layer stack", sites=1, where=WHERE
    )
