"""The report tells a model's layers apart and says what each site does."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashpass
from flashpass.layers import display_path

nn = pytest.importorskip("flax.linen")


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.MultiHeadDotProductAttention(
            num_heads=2, qkv_features=16, deterministic=True, name="attn"
        )(x)
        return x + nn.Dense(16)(h)


class Decoder(nn.Module):
    layers: int = 4

    @nn.compact
    def __call__(self, x):
        for i in range(self.layers):
            x = Block(name=f"layers_{i}")(x)
        return x


def test_four_layers_have_four_names():
    model = Decoder()
    x = jnp.ones((1, 8, 16))
    params = model.init(jax.random.key(0), x)
    opt = flashpass.optimize(model.apply, kernel="blockwise")
    jax.jit(opt)(params, x)  # the first call, under jit
    (report,) = opt.reports
    assert len(report.rewrites) == 4, str(report)
    layers = [r.layer for r in report.rewrites]
    assert len(set(layers)) == 4, layers
    for i, layer in enumerate(layers):
        assert layer.endswith(f"layers_{i}/attn"), layers
    # every site's source line is the library's: only the layer tells them apart
    assert len({r.location for r in report.rewrites}) == 1
    text = str(report)
    assert "layer" in text.splitlines()[3] and all(name in text for name in layers)
    assert "flax/linen/attention.py:" in text  # relative to its sys.path entry


def test_layer_without_a_name_stack_is_the_users_line():
    def attention(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)

    def model(q, k, v):
        return jax.nn.dot_product_attention(q, k, v) + attention(q, k, v)

    q = jnp.ones((1, 16, 2, 8))
    report = flashpass.optimize(model, kernel="blockwise").explain(q, q, q)
    assert len(report.rewrites) == 2, str(report)
    here = os.path.basename(__file__)
    for r in report.rewrites:
        assert r.layer.split(":")[0].endswith(here), r.layer


_LIBRARY_SOURCE = """
import jax
import jax.numpy as jnp


def _jitted(fn):
    return jax.jit(lambda *a: fn(*a))  # a library's jit wrapper (equinox's filter_jit)


einsum = _jitted(lambda a, b: jnp.einsum("bhqk,bkhd->bqhd", a, b))


def attention(q, k, v):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k)
    return einsum(jax.nn.softmax(s, axis=-1), v)
"""


def test_layer_through_a_library_jit_helper_is_the_users_line():
    """haliax's products run through equinox's ``filter_jit``: the equation's
    traceback stops at the jit boundary (the wrapper's frame only), and the
    user's line is in the holding call's traceback."""
    import sysconfig

    path = os.path.join(sysconfig.get_paths()["purelib"], "fake_attention_library.py")
    lib: dict = {}
    exec(compile(_LIBRARY_SOURCE, path, "exec"), lib)

    def model(q, k, v):
        return lib["attention"](q, k, v)

    q = jnp.ones((1, 16, 2, 8))
    report = flashpass.optimize(model, kernel="blockwise").explain(q, q, q)
    assert len(report.rewrites) == 1, str(report)
    here = os.path.basename(__file__)
    assert report.rewrites[0].layer.split(":")[0].endswith(here), report.rewrites[0].layer


def test_dot_product_attention_without_groups_is_not_grouped():
    q = jnp.ones((1, 16, 2, 8))
    kv = jnp.ones((1, 16, 1, 8))
    opt = flashpass.optimize(jax.nn.dot_product_attention, kernel="blockwise")
    (plain,) = opt.explain(q, q, q).rewrites
    assert "grouped" not in plain.pattern and plain.q_shape == (1, 16, 2, 8), plain
    (gqa,) = opt.explain(q, kv, kv).rewrites
    assert "grouped" in gqa.pattern, gqa


def test_dropout_column():
    def attention(q, k, v, key):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k)
        p = jax.nn.softmax(s, axis=-1)
        keep = jax.random.bernoulli(key, 0.9, p.shape)
        p = jnp.where(keep, p / 0.9, 0.0)
        return jnp.einsum("bhqk,bkhd->bqhd", p, v)

    q = jnp.ones((1, 16, 2, 8))
    report = flashpass.optimize(attention, kernel="blockwise").explain(q, q, q, jax.random.key(0))
    if not report.rewrites:
        pytest.skip(f"dropout spelling not matched here: {report}")
    assert report.rewrites[0].dropout
    header, _, row = str(report).splitlines()[3:6]
    assert "dropout" in header
    column = header.index("dropout")
    assert row[column:].startswith("yes"), str(report)


def test_one_reason_per_kept_site():
    """The kernel's own rejection is not repeated under the reason it became."""

    def attention(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)

    q = jnp.ones((1, 64, 2, 8))
    report = flashpass.explain(attention, q, q, q)  # the default order: too short
    (fallback,) = report.fallbacks
    text = str(report)
    assert text.count("short sequence") == 1, text


def test_locations_are_shown_relative():
    here = os.path.abspath(__file__)
    shown = display_path(f"{here}:12")
    assert not os.path.isabs(shown.rsplit(":", 1)[0]) and shown.endswith("test_report_layers.py:12")
    assert display_path(None) == "?"
    np.testing.assert_equal(display_path("relative/file.py:3"), "relative/file.py:3")
