"""The README's ten-line example (run: python examples/readme_example.py)."""

import jax
import jax.numpy as jnp

import flashpass


@flashpass.optimize  # or flashpass.optimize(model.apply, ...)
def attention(q, k, v):  # [batch, seq, heads, head_dim]
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(q.shape[-1])
    s = jnp.where(jnp.tril(jnp.ones((q.shape[1], k.shape[1]), bool)), s, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


if __name__ == "__main__":
    q = k = v = jnp.ones((1, 4096, 8, 64))
    out = attention(q, k, v)  # same values, flash-attention memory and speed
    print(attention.explain(q, k, v))  # what was rewritten, and why not
