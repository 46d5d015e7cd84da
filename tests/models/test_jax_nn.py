"""``jax.nn.dot_product_attention(implementation="xla")``: the call users expect
to get faster.  It spells grouped-query attention as 5-D einsums and builds its
masks (causal, padding lengths, local windows) from iotas.

JAX's own frames are not user frames, so report locations point at the line of
this file that calls ``jax.nn.dot_product_attention``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

B, T, S, HEADS, D = 2, 16, 24, 4, 8
WHERE = "tests/models/test_jax_nn.py"


def _normal(seed, shape, dtype=jnp.float32):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def _qkv(t=T, s=T, heads=HEADS, kv_heads=HEADS, dtype=jnp.float32):
    return (
        _normal(0, (B, t, heads, D), dtype),
        _normal(1, (B, s, kv_heads, D), dtype),
        _normal(2, (B, s, kv_heads, D), dtype),
    )


def _attend(names, kwargs):
    def fn(qkv, *extra):
        bias = qkv[3] if len(qkv) > 3 else None
        more = dict(zip(names, extra, strict=True))
        return jax.nn.dot_product_attention(
            qkv[0], qkv[1], qkv[2], bias=bias, implementation="xla", **kwargs, **more
        )

    return fn


def _lengths(*lengths):
    return jnp.asarray(np.array(lengths, np.int32))


#: name -> () -> (params, extra inputs, their keyword names, fixed keyword arguments)
CASES = {
    "plain": lambda: (_qkv(), (), (), {}),
    "causal": lambda: (_qkv(), (), (), {"is_causal": True}),
    "bias": lambda: ((*_qkv(), _normal(3, (1, HEADS, T, T))), (), (), {}),
    "mask": lambda: (
        _qkv(),
        (jnp.asarray(np.arange(T)[None, None, None, :] < np.array([T, 9])[:, None, None, None]),),
        ("mask",),
        {},
    ),
    "seq lengths": lambda: (
        _qkv(),
        (_lengths(T, 10), _lengths(T, 9)),
        ("query_seq_lengths", "key_value_seq_lengths"),
        {},
    ),
    "GQA (4 q heads / 2 kv heads), causal": lambda: (_qkv(kv_heads=2), (), (), {"is_causal": True}),
    "MQA (1 kv head)": lambda: (_qkv(kv_heads=1), (), (), {}),
    "cross (T != S)": lambda: (_qkv(s=S), (), (), {}),
    "single-query decode, GQA": lambda: (_qkv(t=1, s=S, kv_heads=2), (), (), {}),
    "local window (4, 0)": lambda: (_qkv(), (), (), {"local_window_size": (4, 0)}),
    "local window (3, 3) + causal": lambda: (
        _qkv(),
        (),
        (),
        {"local_window_size": (3, 3), "is_causal": True},
    ),
    "bf16, causal, GQA": lambda: (
        _qkv(kv_heads=2, dtype=jnp.bfloat16),
        (),
        (),
        {"is_causal": True},
    ),
    "scale=0.3": lambda: (_qkv(), (), (), {"scale": 0.3}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_dot_product_attention(check_model, name):
    params, extra, names, kwargs = CASES[name]()
    fn = _attend(names, kwargs)
    report = check_model(
        fn,
        tuple(params),
        *extra,
        library="jax.nn",
        case=f"dot_product_attention(implementation='xla') {name}",
        sites=1,
        where=WHERE,
    )
    if kwargs.get("is_causal"):
        assert all(r.causal for r in report.rewrites), str(report)
