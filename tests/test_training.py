"""Whole training steps: ``optimize(train_step)`` rewrites attention forward and backward.

Each test wraps a function that differentiates its own loss, makes the first
call under ``jax.jit`` (as training scripts do), and checks that

* the report shows every site rewritten, "forward+backward" where the program
  differentiates it (a checkpointed layer also has its forward-only copy);
* the loss and the updated parameters equal the original step's.

Negative tests: a backward that reads the probabilities for something else,
and returned attention weights keep the site and say why.
"""

from __future__ import annotations

import functools
import os

os.environ.setdefault("KERAS_BACKEND", "jax")  # before keras is imported (as tests/models does)

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import checkpoint_name
from t_by_s import assert_no_t_by_s, jaxpr_shapes

import flashpass

import spellings

B, T, H, D = 2, 32, 2, 8
E = H * D


def _attention(p, x, causal=True):
    q, k, v = ((x @ p[n]).reshape(B, T, H, D) for n in "qkv")
    s = jnp.einsum("bthd,bshd->bhts", q, k) / np.sqrt(D)
    if causal:
        s = jnp.where(jnp.tril(jnp.ones((T, T), bool)), s, -1e9)
    a = jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, -1), v).reshape(B, T, E)
    return a @ p["o"]


def _layer(p, x):
    x = x + _attention(p, x)
    return x + jnp.tanh(x @ p["m"])


def _params(layers=2, seed=0):
    rng = np.random.default_rng(seed)
    return {n: jnp.asarray(rng.normal(size=(layers, E, E)) * 0.3, jnp.float32) for n in "qkvom"}


def _inputs(seed=1):
    return jnp.asarray(np.random.default_rng(seed).normal(size=(B, T, E)), jnp.float32)


def _stack(ps, wrap=lambda f: f):
    def loss(ps, x):
        for i in range(jax.tree.leaves(ps)[0].shape[0]):
            x = wrap(_layer)(jax.tree.map(lambda a, i=i: a[i], ps), x)
        return jnp.mean(x**2)

    return loss


def _sgd_step(loss):
    def step(ps, x):
        value, grads = jax.value_and_grad(loss)(ps, x)
        return value, jax.tree.map(lambda a, g: a - 0.1 * g, ps, grads)

    return step


def _scanned_loss(ps, x):
    """The layers under ``lax.scan`` (no remat)."""
    x, _ = jax.lax.scan(lambda x, p: (_layer(p, x), None), x, ps)
    return jnp.mean(x**2)


def _accumulating_step(loss):
    """A step accumulating ``loss``'s gradients over micro-batches under ``lax.scan``."""

    def step(ps, xs):
        def micro(acc, x):
            value, grads = jax.value_and_grad(loss)(ps, x)
            return jax.tree.map(jnp.add, acc, grads), value

        grads, values = jax.lax.scan(micro, jax.tree.map(jnp.zeros_like, ps), xs)
        return values.mean(), jax.tree.map(lambda a, g: a - 0.1 * g, ps, grads)

    return step


def _assert_same(actual, expected, rtol=1e-5):
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        a, e = np.asarray(a, np.float32), np.asarray(e, np.float32)
        scale = max(float(np.max(np.abs(e))), 1e-6)
        assert float(np.max(np.abs(a - e))) <= rtol * scale + 1e-7, float(np.max(np.abs(a - e)))


def _run(step, *args, kernel="blockwise", **opts):
    opt = flashpass.optimize(step, kernel=kernel, **opts)
    out = jax.jit(opt)(*args)  # the first call, under jit
    _assert_same(out, jax.jit(step)(*args))
    return opt.reports[-1]


def _passes(report) -> list[str]:
    return sorted(r.passes for r in report.rewrites)


# --------------------------------------------------------------------------- positive


def test_value_and_grad_step():
    report = _run(_sgd_step(_stack(_params())), _params(), _inputs())
    assert _passes(report) == ["forward+backward"] * 2 and not report.fallbacks
    assert all(r.causal for r in report.rewrites)
    assert "forward+backward" in str(report)


@pytest.mark.parametrize("how", ["jit_of_optimize", "optimize_of_jit", "direct"])
def test_calling_conventions(how):
    step = _sgd_step(_stack(_params()))
    args = (_params(), _inputs())
    if how == "jit_of_optimize":
        opt = flashpass.optimize(step, kernel="blockwise")
        out = jax.jit(opt)(*args)
    elif how == "optimize_of_jit":
        opt = flashpass.optimize(jax.jit(step), kernel="blockwise")
        out = opt(*args)
    else:
        opt = flashpass.optimize(step, kernel="blockwise")
        out = opt(*args)
    _assert_same(out, step(*args))
    assert _passes(opt.reports[-1]) == ["forward+backward"] * 2


@pytest.mark.parametrize("where", ["optimize_outside", "optimize_inside"])
def test_train_step_in_a_users_shard_map(where):
    # A train step run per shard by the user's shard_map, optimized around it or inside.
    from jax.sharding import PartitionSpec as P

    step = _sgd_step(_stack(_params()))
    mesh = jax.make_mesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    # The same step outside first: a backward template traced there (cached) must not
    # serve the shard_map body, whose types vary over the manual axes.
    jax.jit(flashpass.optimize(step, kernel="blockwise"))(_params(), _inputs())

    def per_shard(fn):
        return jax.shard_map(fn, mesh=mesh, in_specs=(P(), P()), out_specs=P())

    if where == "optimize_outside":
        opt = flashpass.optimize(per_shard(step), kernel="blockwise")
        run = jax.jit(opt)
    else:
        opt = flashpass.optimize(step, kernel="blockwise")
        run = jax.jit(per_shard(opt))
    args = (_params(), _inputs())
    _assert_same(run(*args), jax.jit(per_shard(step))(*args))
    assert _passes(opt.reports[-1]) == ["forward+backward"] * 2


def test_data_parallel_train_step_in_a_users_shard_map():
    # The batch varies over the manual axis (check_vma): the program's types vary,
    # the backward template is traced without them (as outside the body) and still
    # matches; the gradients are psum'd by the user.
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    loss = _stack(_params())

    def body(ps, x):
        value, grads = jax.value_and_grad(loss)(ps, x)
        return jax.lax.psum(value, "x"), jax.tree.map(lambda g: jax.lax.psum(g, "x"), grads)

    step = jax.shard_map(body, mesh=mesh, in_specs=(P(), P("x")), out_specs=(P(), P()))
    opt = flashpass.optimize(step, kernel="blockwise")
    args = (_params(), _inputs())
    _assert_same(jax.jit(opt)(*args), jax.jit(step)(*args))
    assert _passes(opt.reports[-1]) == ["forward+backward"] * 2


@pytest.mark.parametrize("argnums", [0, 1, (0, 1)])
def test_grad_argnums(argnums):
    loss = _stack(_params())

    def step(ps, x):
        return jax.grad(loss, argnums=argnums)(ps, x)

    report = _run(step, _params(), _inputs())
    assert _passes(report) == ["forward+backward"] * 2


def test_has_aux_and_partial_inputs():
    # The value of v is not differentiated in the loss: only q and k get cotangents.
    def loss(q, k, v):
        out = spellings.einsum_btnh(q, k, jax.lax.stop_gradient(v))
        return jnp.sum(out**2), out.mean()

    def step(q, k, v):
        (value, aux), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(q, k, v)
        return value, aux, grads

    report = _run(step, *spellings.btnh(np.random.default_rng(0)))
    assert _passes(report) == ["forward+backward"]


@pytest.mark.parametrize("name", sorted(spellings.POSITIVE))
def test_every_spelling(name):
    fn, make = spellings.POSITIVE[name]
    args = make(np.random.default_rng(0))
    floats = tuple(i for i, a in enumerate(args) if jnp.issubdtype(a.dtype, jnp.floating))
    ct = jnp.asarray(np.random.default_rng(1).normal(size=jax.eval_shape(fn, *args).shape))

    def step(*a):
        return jax.value_and_grad(lambda *a: jnp.sum(fn(*a).astype(jnp.float32) * ct), floats)(*a)

    low = any(a.dtype == jnp.bfloat16 for a in args) or "mixed" in name
    opt = flashpass.optimize(step, kernel="blockwise")
    _assert_same(jax.jit(opt)(*args), jax.jit(step)(*args), rtol=2e-2 if low else 1e-4)
    report = opt.reports[-1]
    if name == "remat":
        # jax.checkpoint around the attention alone: its backward recomputes the
        # probabilities but not the output (dead there), so only the forward is rewritten.
        assert _passes(report) == ["forward"] and len(report.fallbacks) == 1
        return
    assert "forward+backward" in _passes(report), str(report)
    assert not report.fallbacks, str(report)


@pytest.mark.parametrize(
    "policy",
    [None, "nothing_saveable", "dots_with_no_batch_dims_saveable"],
)
def test_checkpointed_layers(policy):
    wrap = functools.partial(
        jax.checkpoint, policy=policy and getattr(jax.checkpoint_policies, policy)
    )
    report = _run(_sgd_step(_stack(_params(), wrap)), _params(), _inputs())
    # The forward copy of each layer, and the recompute + backward inside its remat.
    assert _passes(report) == ["forward"] * 2 + ["forward+backward"] * 2
    assert not report.fallbacks


@pytest.mark.parametrize(
    "policy",
    [
        "dots_saveable",
        "everything_saveable",
        "save_anything_except_these_names",
        "save_only_these_names",
    ],
)
def test_checkpoint_policies_that_save_attention_values(policy):
    # The policy saves intermediates of the site (the scores, or everything) for the
    # remat body, which is then the backward, recomputing what was not saved: the
    # forward and that body are proven as one site (scans.match_remat).
    pol = getattr(jax.checkpoint_policies, policy)
    pol = pol("q_proj") if "names" in policy else pol

    def layer(p, x):
        q = checkpoint_name(x @ p["q"], "q_proj").reshape(B, T, H, D)
        k, v = ((x @ p[n]).reshape(B, T, H, D) for n in "kv")
        s = jnp.einsum("bthd,bshd->bhts", q, k) / np.sqrt(D)
        s = jnp.where(jnp.tril(jnp.ones((T, T), bool)), s, -1e9)
        a = jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, -1), v).reshape(B, T, E)
        return x + jnp.tanh((x + a @ p["o"]) @ p["m"])

    loss = _stack(_params(), lambda f: jax.checkpoint(layer, policy=pol))
    report = _run(_sgd_step(loss), _params(), _inputs())
    assert "forward+backward" in _passes(report) and not report.fallbacks, str(report)
    assert _passes(report).count("forward+backward") == 2


def test_checkpointed_layers_under_scan():
    def loss(ps, x):
        x, _ = jax.lax.scan(lambda x, p: (jax.checkpoint(_layer)(p, x), None), x, ps)
        return jnp.mean(x**2)

    report = _run(_sgd_step(loss), _params(), _inputs())
    assert _passes(report) == ["forward", "forward+backward"]
    assert not report.fallbacks


def test_layers_under_scan():
    # The forward loop saves the probabilities for the backward loop: both loops
    # are re-emitted, the kernel's residuals (q, k, v, output, logsumexp) stacked.
    step = _sgd_step(_scanned_loss)
    report = _run(step, _params(3), _inputs())
    assert _passes(report) == ["forward+backward"] and not report.fallbacks
    opt = flashpass.optimize(step, kernel="blockwise")
    # No T×S residual stacked over the layers (in any layout) remains; at T = 32
    # the kernel's one tile spans a layer's [B, H, T, T], hence copies.
    control = jaxpr_shapes(jax.make_jaxpr(step)(_params(3), _inputs()))
    assert (3, B, H, T, T) in control  # the original stacks the probabilities
    shapes = jaxpr_shapes(opt.rewritten_jaxpr(_params(3), _inputs()))
    assert_no_t_by_s(shapes, T, T, copies=3 * B * H, control=control)


def test_nested_scans_gradient_accumulation_over_scanned_layers():
    step = _accumulating_step(_scanned_loss)
    report = _run(step, _params(2), jnp.stack([_inputs(1), _inputs(2)]))
    assert _passes(report) == ["forward+backward"] and not report.fallbacks


def test_gradient_accumulation_under_scan():
    step = _accumulating_step(_stack(_params(1)))
    xs = jnp.stack([_inputs(1), _inputs(2), _inputs(3)])
    report = _run(step, _params(1), xs)
    assert _passes(report) == ["forward+backward"]
    assert report.rewrites[0].scope.startswith("scan body")


def test_per_example_gradients_under_vmap():
    # vmap of grad batches the backward JAX wrote for one example: equal to the vjp of
    # the batched forward up to how constants and mask broadcasts are built.
    loss = _stack(_params(1))

    def step(ps, xs):
        per_example = jax.vmap(jax.grad(loss), in_axes=(None, 0))(ps, xs)
        return jax.tree.map(lambda g: jnp.mean(g**2, axis=(1, 2, 3)), per_example)

    xs = jnp.stack([_inputs(1), _inputs(2)])
    report = _run(step, _params(1), xs)
    assert _passes(report) == ["forward+backward"]


def test_train_and_eval_in_one_function():
    loss = _stack(_params(1))

    def step(ps, x, x_eval):
        value, grads = jax.value_and_grad(loss)(ps, x)
        return value, grads, loss(ps, x_eval)

    report = _run(step, _params(1), _inputs(1), _inputs(2))
    assert _passes(report) == ["forward", "forward+backward"]


# --------------------------------------------------------------------------- libraries


def test_flax_linen_with_optax():
    nn = pytest.importorskip("flax.linen")
    optax = pytest.importorskip("optax")

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
            x = x + nn.MultiHeadDotProductAttention(num_heads=H, use_bias=False)(x, mask=mask)
            return x + nn.Dense(E)(nn.gelu(nn.Dense(2 * E)(x)))

    model = Block()
    x = _inputs()
    params = model.init(jax.random.key(0), x)
    tx = optax.adam(1e-3)

    def step(params, opt_state, x):
        value, grads = jax.value_and_grad(lambda p: jnp.mean(model.apply(p, x) ** 2))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return value, optax.apply_updates(params, updates), opt_state

    report = _run(step, params, tx.init(params), x)
    assert _passes(report) == ["forward+backward"]
    assert "flax" in report.rewrites[0].location


def test_flax_nnx_split_state():
    nnx = pytest.importorskip("flax.nnx")
    model = nnx.MultiHeadAttention(num_heads=H, in_features=E, decode=False, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)

    def step(state, x):
        def loss(state):
            return jnp.mean(nnx.merge(graphdef, state)(x) ** 2)

        value, grads = jax.value_and_grad(loss)(state)
        return value, jax.tree.map(lambda a, g: a - 0.1 * g, state, grads)

    report = _run(step, state, _inputs())
    assert _passes(report) == ["forward+backward"]


def test_equinox_with_optax():
    eqx = pytest.importorskip("equinox")
    optax = pytest.importorskip("optax")
    mha = eqx.nn.MultiheadAttention(H, E, key=jax.random.key(0))
    params, static = eqx.partition(mha, eqx.is_array)
    tx = optax.sgd(0.1)

    def step(params, opt_state, x):
        def loss(params):
            model = eqx.combine(params, static)
            return jnp.mean(jax.vmap(lambda t: model(t, t, t))(x) ** 2)

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return value, optax.apply_updates(params, updates), opt_state

    report = _run(step, params, tx.init(params), _inputs())
    assert _passes(report) == ["forward+backward"]


def test_keras_stateless_training_step():
    keras = pytest.importorskip("keras")
    if keras.backend.backend() != "jax":
        pytest.skip("keras runs on another backend")
    inputs = keras.Input((T, E))
    x = keras.layers.MultiHeadAttention(num_heads=H, key_dim=D)(
        inputs, inputs, use_causal_mask=True
    )
    model = keras.Model(inputs, keras.layers.Dense(E)(x))
    trainable = [v.value for v in model.trainable_variables]
    frozen = [v.value for v in model.non_trainable_variables]

    def step(trainable, frozen, x):
        def loss(trainable):
            y, _ = model.stateless_call(trainable, frozen, x)
            return jnp.mean(y**2)

        value, grads = jax.value_and_grad(loss)(trainable)
        return value, [a - 0.1 * g for a, g in zip(trainable, grads, strict=True)]

    report = _run(step, trainable, frozen, _inputs())
    assert _passes(report) == ["forward+backward"]


# --------------------------------------------------------------------------- dropout


def _dropout_attention(q, k, v, key, rate=0.1):
    p = jax.nn.softmax(jnp.einsum("bthd,bshd->bhts", q, k) / np.sqrt(D), -1)
    keep = jax.random.bernoulli(key, 1 - rate, p.shape)
    return jnp.einsum("bhts,bshd->bthd", jnp.where(keep, p / (1 - rate), 0), v)


def test_dropout_training_step():
    # The same keep-mask, regenerated by the kernel in its forward and its backward.
    def step(q, k, v, key):
        loss = lambda *a: jnp.sum(_dropout_attention(*a, key) ** 2)  # noqa: E731
        return jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)

    args = (*spellings.btnh(np.random.default_rng(0)), jax.random.key(3))
    report = _run(step, *args)
    assert _passes(report) == ["forward+backward"]
    assert "dropout" in str(report.rewrites[0].spec)


def test_flax_dropout_training_step():
    nn = pytest.importorskip("flax.linen")

    model = nn.MultiHeadDotProductAttention(num_heads=H, dropout_rate=0.1, use_bias=False)
    x = _inputs()
    params = model.init(jax.random.key(0), x, deterministic=True)

    def step(params, x, key):
        def loss(params):
            y = model.apply(params, x, deterministic=False, rngs={"dropout": key})
            return jnp.mean(y**2)

        value, grads = jax.value_and_grad(loss)(params)
        return value, jax.tree.map(lambda a, g: a - 0.1 * g, params, grads)

    report = _run(step, params, x, jax.random.key(7))
    assert _passes(report) == ["forward+backward"]


# --------------------------------------------------------------------------- negative


def test_probabilities_also_in_the_loss_are_kept():
    def loss(q, k, v):
        p = jax.nn.softmax(jnp.einsum("bthd,bshd->bhts", q, k), -1)
        return jnp.sum(jnp.einsum("bhts,bshd->bthd", p, v) ** 2) + jnp.sum(p**2)

    report = _run(jax.grad(loss, argnums=(0, 1, 2)), *spellings.btnh(np.random.default_rng(0)))
    assert not report.rewrites
    assert "backward pass" in report.fallbacks[0].reason


def test_returned_weights_are_kept():
    def loss(q, k, v):
        p = jax.nn.softmax(jnp.einsum("bthd,bshd->bhts", q, k), -1)
        return jnp.sum(jnp.einsum("bhts,bshd->bthd", p, v) ** 2), p

    step = jax.value_and_grad(loss, has_aux=True)
    report = _run(step, *spellings.btnh(np.random.default_rng(0)))
    assert not report.rewrites
    assert report.fallbacks
