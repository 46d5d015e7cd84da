"""Adversarial soundness tests for training steps: programs a user could write.

Every case compares ``jax.jit(optimize(f, kernel="blockwise"))`` against
``jax.jit(f)`` (forward values and gradients) and checks the report:

* positive cases: the site is rewritten ``forward+backward`` (or as stated) and
  the results match;
* negative cases: the program is not autodiff's plain vjp of the attention
  (higher-order derivatives, forward mode, probabilities reused...), so the site
  must be kept, with a reason, and the results still match.

Every kept site has a non-empty reason (`_run`); cases whose reason was once
misleading assert the words it must (or must not) contain.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashpass

B, T, H, D = 2, 16, 2, 8
E = H * D


def _normal(seed, shape, dtype=jnp.float32):
    x = np.random.default_rng(seed).normal(size=shape).astype(np.float32)
    return jnp.asarray(x).astype(dtype)


def _qkv(seed=0, dtype=jnp.float32):
    return tuple(_normal(seed + i, (B, T, H, D), dtype) for i in range(3))


def _att(q, k, v, bias=None, mask=None, scale=None):
    s = jnp.einsum("bthd,bshd->bhts", q, k) * (1 / np.sqrt(D) if scale is None else scale)
    if bias is not None:
        s = s + bias
    if mask is not None:
        s = jnp.where(mask, s, -1e9)
    return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, -1), v)


def _sq(o):
    return jnp.sum(o.astype(jnp.float32) ** 2)


def _assert_same(actual, expected, rtol):
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        a, e = np.asarray(a, np.float32), np.asarray(e, np.float32)
        scale = max(float(np.max(np.abs(e))), 1e-6)
        assert float(np.max(np.abs(a - e))) <= rtol * scale + 1e-7, float(np.max(np.abs(a - e)))


def _run(step, *args, rtol=1e-5):
    opt = flashpass.optimize(step, kernel="blockwise")
    _assert_same(jax.jit(opt)(*args), jax.jit(step)(*args), rtol)
    report = opt.reports[-1]
    assert not report.errors, str(report)
    assert all(f.reason.strip() for f in report.fallbacks), str(report)
    return report


def _passes(report) -> list[str]:
    return sorted(r.passes for r in report.rewrites)


def _reasons(report) -> str:
    return " | ".join(f.reason for f in report.fallbacks)


# ------------------------------------------------------------------ flat programs

_Q, _K, _V = _qkv()
_Q2 = _normal(7, (B, T, H, D))
_BIAS = _normal(10, (1, H, T, T)) * 0.5
_W = _normal(33, (D, D)) * 0.3
_CAUSAL = jnp.tril(jnp.ones((T, T), bool))


def _vg(loss, argnums=(0, 1, 2), **kw):
    return jax.value_and_grad(loss, argnums, **kw)


@jax.custom_vjp
def _scaled_ct(q, k, v):
    return _att(q, k, v)


_scaled_ct.defvjp(lambda *a: jax.vjp(_att, *a), lambda pb, ct: pb(ct * 0.5))


@jax.custom_vjp
def _swapped(q, k, v):
    return _att(q, k, v)


def _swapped_bwd(pb, ct):
    dq, dk, dv = pb(ct)
    return dk, dq, dv


_swapped.defvjp(lambda *a: jax.vjp(_att, *a), _swapped_bwd)


@jax.custom_jvp
def _tripled(q, k, v):
    return _att(q, k, v)


@_tripled.defjvp
def _tripled_jvp(primals, tangents):
    out, dout = jax.jvp(_att, primals, tangents)
    return out, dout * 3.0


def _hand_softmax(stop_max: bool):
    def loss(q, k, v):
        s = jnp.einsum("bthd,bshd->bhts", q, k) / np.sqrt(D)
        m = s.max(-1, keepdims=True)
        s = s - (jax.lax.stop_gradient(m) if stop_max else m)
        e = jnp.exp(s)
        return _sq(jnp.einsum("bhts,bshd->bthd", e / e.sum(-1, keepdims=True), v))

    return loss


def _linear_transpose(*a):
    o, f = jax.linearize(_att, *a)
    return jax.linear_transpose(f, *a)(o)


def _output_used_three_times(q, k, v):
    o = _att(q, k, v)
    return _sq(o) + jnp.sum(jnp.sin(o)) + o.mean()


def _padded(q, k, v, b):
    # batch element 0 has no valid key: a fully masked row
    m = (jnp.arange(T)[None, :] < jnp.array([0, 5])[:, None])[:, None, None, :]
    return _sq(_att(q, k, v, bias=b, mask=m))


def _alibi(q, k, v, slopes):
    pos = (jnp.arange(T)[:, None] - jnp.arange(T)[None, :]).astype(jnp.float32)
    return _sq(_att(q, k, v, bias=(slopes[:, None, None] * pos * 0.1)[None]))


def _mixed_bf16(q, k, v):
    s = jnp.einsum("bthd,bshd->bhts", q, k).astype(jnp.float32) / np.sqrt(D)
    p = jax.nn.softmax(s, -1).astype(jnp.bfloat16)
    return _sq(jnp.einsum("bhts,bshd->bthd", p, v))


def _gqa(q, k, v):
    return _sq(_att(q, jnp.repeat(k, H, axis=2), jnp.repeat(v, H, axis=2)))


_KG, _VG = _normal(20, (B, T, 1, D)), _normal(21, (B, T, 1, D))
_QB, _KB, _VB = _qkv(0, jnp.bfloat16)

#: name -> (step, args, expected passes, rtol)
POSITIVE = {
    "self_attention_q_k_v_one_array": (
        jax.value_and_grad(lambda x: _sq(_att(x, x, x))),
        (_Q,),
    ),
    "tied_q_k": (_vg(lambda x, v: _sq(_att(x, x, v)), (0, 1)), (_Q, _V)),
    "tied_k_v": (_vg(lambda q, x: _sq(_att(q, x, x)), (0, 1)), (_Q, _K)),
    "output_used_three_times": (_vg(_output_used_three_times), (_Q, _K, _V)),
    "output_times_its_own_input": (_vg(lambda q, k, v: jnp.sum(_att(q, k, v) * q)), (_Q, _K, _V)),
    "same_attention_twice_no_cse": (
        _vg(lambda *a: _sq(_att(*a) + _att(*a))),
        (_Q, _K, _V),
        ["forward+backward"] * 2,
    ),
    "two_queries_share_k_v": (
        _vg(lambda q, q2, k, v: jnp.sum(_att(q, k, v) * _att(q2, k, v)), (0, 1, 2, 3)),
        (_Q, _Q2, _K, _V),
        ["forward+backward"] * 2,
    ),
    "stop_gradient_on_k": (
        _vg(lambda q, k, v: _sq(_att(q, jax.lax.stop_gradient(k), v))),
        (_Q, _K, _V),
    ),
    "grad_wrt_v_only": (jax.grad(lambda *a: _sq(_att(*a)), 2), (_Q, _K, _V)),
    "custom_vjp_bwd_is_vjp_of_scaled_ct": (_vg(lambda *a: _sq(_scaled_ct(*a))), (_Q, _K, _V)),
    "custom_vjp_bwd_swaps_dq_dk": (_vg(lambda *a: _sq(_swapped(*a))), (_Q, _K, _V)),
    "custom_jvp_triples_tangents": (_vg(lambda *a: _sq(_tripled(*a))), (_Q, _K, _V)),
    "explicit_vjp_cotangent_is_output": (
        lambda *a: (lambda o, pb: (o, pb(o)))(*jax.vjp(_att, *a)),
        (_Q, _K, _V),
    ),
    "linearize_then_linear_transpose": (_linear_transpose, (_Q, _K, _V)),
    "learned_bias_broadcast_over_batch": (
        _vg(lambda q, k, v, b: _sq(_att(q, k, v, bias=b)), (0, 1, 2, 3)),
        (_Q, _K, _V, _BIAS),
    ),
    "bias_gradient_only": (
        jax.grad(lambda q, k, v, b: _sq(_att(q, k, v, bias=b)), 3),
        (_Q, _K, _V, _BIAS),
    ),
    "bias_also_in_a_regulariser": (
        _vg(lambda q, k, v, b: _sq(_att(q, k, v, bias=b)) + jnp.sum(b**2), (0, 1, 2, 3)),
        (_Q, _K, _V, _BIAS),
    ),
    "learned_alibi_slopes": (_vg(_alibi, (0, 1, 2, 3)), (_Q, _K, _V, _normal(12, (H,)))),
    "padding_fully_masked_row_learned_bias": (_vg(_padded, (0, 1, 2, 3)), (_Q, _K, _V, _BIAS)),
    "learned_temperature": (
        _vg(lambda q, k, v, t: _sq(_att(q, k, v, scale=t)), (0, 1, 2, 3)),
        (_Q, _K, _V, jnp.float32(0.7)),
    ),
    "per_head_learned_temperature": (
        _vg(lambda q, k, v, t: _sq(_att(q, k, v, scale=t[None, :, None, None])), (0, 1, 2, 3)),
        (_Q, _K, _V, _normal(13, (H,)) * 0.1 + 0.3),
    ),
    "gqa_repeat": (_vg(_gqa), (_Q, _KG, _VG)),
    "bf16_mixed_f32_softmax": (_vg(_mixed_bf16), (_QB, _KB, _VB), None, 2e-2),
    "hand_softmax_stop_gradient_max": (_vg(_hand_softmax(True)), (_Q, _K, _V)),
    "hand_softmax_differentiated_max": (_vg(_hand_softmax(False)), (_Q, _K, _V)),
    "dot_product_attention_learned_bias": (
        _vg(lambda q, k, v, b: _sq(jax.nn.dot_product_attention(q, k, v, bias=b)), (0, 1, 2, 3)),
        (_Q, _K, _V, _BIAS),
    ),
}


@pytest.mark.parametrize("name", sorted(POSITIVE))
def test_rewritten_forward_and_backward(name):
    step, args, *rest = POSITIVE[name]
    passes = (rest[0] if rest else None) or ["forward+backward"]
    rtol = rest[1] if len(rest) > 1 else 1e-5
    report = _run(step, *args, rtol=rtol)
    assert _passes(report) == passes, str(report)
    assert not report.fallbacks, str(report)


# ------------------------------------------------------------------ kept, with a reason


def _probabilities_in_aux(q, k, v):
    p = jax.nn.softmax(jnp.einsum("bthd,bshd->bhts", q, k) / np.sqrt(D), -1)
    return _sq(jnp.einsum("bhts,bshd->bthd", p, v)), p.max()


def _stop_gradient_probabilities(q, k, v):
    p = jax.nn.softmax(jnp.einsum("bthd,bshd->bhts", q, k) / np.sqrt(D), -1)
    return _sq(jnp.einsum("bhts,bshd->bthd", jax.lax.stop_gradient(p), v))


def _hvp(q, k, v):
    return jax.jvp(lambda q: jax.grad(lambda *a: _sq(_att(*a)))(q, k, v), (q,), (q,))


def _pullback_twice(q, k, v):
    o, pb = jax.vjp(_att, q, k, v)
    return o, pb(o), pb(jnp.ones_like(o))


def _k_v_one_array_with_residual(x, w):
    return _sq(x + _att(jnp.einsum("bthd,de->bthe", x, w), x, x))


#: name -> (step, args, a fragment of the reason)
KEPT = {
    "probabilities_in_aux": (
        _vg(_probabilities_in_aux, has_aux=True),
        (_Q, _K, _V),
        "backward pass that shares",
    ),
    "stop_gradient_probabilities": (
        _vg(_stop_gradient_probabilities),
        (_Q, _K, _V),
        "stop_gradient",
    ),
    "hessian_vector_product": (_hvp, (_Q, _K, _V), "backward pass"),
    "grad_of_grad": (
        jax.grad(lambda q, k, v: _sq(jax.grad(lambda *a: _sq(_att(*a)))(q, k, v))),
        (_Q, _K, _V),
        "backward pass",
    ),
    "forward_mode_jvp": (
        lambda *a: jax.jvp(_att, a, a),
        (_Q, _K, _V),
        "does not compute vjp(attention)",
    ),
    "pullback_called_twice": (_pullback_twice, (_Q, _K, _V), "backward pass that shares"),
    # k and v are one array that the loss also reads elsewhere: autodiff accumulates
    # its cotangents in another order than the template's add_any.
    "k_v_one_array_with_residual": (
        _vg(_k_v_one_array_with_residual, (0, 1)),
        (_Q, _W),
        "backward pass",
    ),
}


@pytest.mark.parametrize("name", sorted(KEPT))
def test_kept_with_a_reason(name):
    step, args, fragment = KEPT[name]
    report = _run(step, *args)
    assert "forward+backward" not in _passes(report), str(report)
    assert report.fallbacks, str(report)
    assert fragment in _reasons(report), _reasons(report)


def test_custom_vjp_with_a_different_hand_written_backward():
    # The custom bwd recomputes attention and returns other gradients: not vjp(att).
    @jax.custom_vjp
    def f(q, k, v):
        return _att(q, k, v)

    def bwd(res, ct):
        q, k, v = res
        p = jax.nn.softmax(jnp.einsum("bthd,bshd->bhts", q, k) / np.sqrt(D), -1)
        dv = jnp.einsum("bhts,bthd->bshd", p, ct)
        dp = jnp.einsum("bthd,bshd->bhts", ct, v)
        ds = p * (dp - jnp.sum(dp * p, -1, keepdims=True)) / np.sqrt(D)
        dq = jnp.einsum("bhts,bshd->bthd", ds, k)
        dk = jnp.einsum("bhts,bthd->bshd", ds, q)
        return dq * 2, dk, -dv

    f.defvjp(lambda q, k, v: (_att(q, k, v), (q, k, v)), bwd)
    report = _run(_vg(lambda *a: _sq(f(*a))), _Q, _K, _V)
    # The primal forward is rewritten alone; the bwd's recomputation is kept.
    assert _passes(report) == ["forward"], str(report)
    assert len(report.fallbacks) == 1


# ------------------------------------------------------------------ layers, scans, remat


def _params(layers, seed=0):
    rng = np.random.default_rng(seed)
    return {n: jnp.asarray(rng.normal(size=(layers, E, E)) * 0.3, jnp.float32) for n in "qkvom"}


_X = _normal(1, (B, T, E))


def _attn(p, x):
    q, k, v = ((x @ p[n]).reshape(B, T, H, D) for n in "qkv")
    return _att(q, k, v, mask=_CAUSAL).reshape(B, T, E) @ p["o"]


def _layer(p, x):
    x = x + _attn(p, x)
    return x + jnp.tanh(x @ p["m"])


def _sgd(loss):
    def step(ps, x):
        value, grads = jax.value_and_grad(loss)(ps, x)
        return value, jax.tree.map(lambda a, g: a - 0.1 * g, ps, grads)

    return step


def _scanned(**kw):
    def loss(ps, x):
        x, _ = jax.lax.scan(lambda x, p: (_layer(p, x), None), x, ps, **kw)
        return jnp.mean(x**2)

    return loss


def _carry_output(ps, x):
    def body(c, p):
        x, a = c
        a2 = _attn(p, x)
        return (x + a2 + 0.5 * a, a2), a2.sum()

    (x, a), ys = jax.lax.scan(body, (x, jnp.zeros_like(x)), ps)
    return jnp.mean(x**2) + jnp.mean(a) + ys.sum()


def _output_as_ys(ps, x):
    def body(x, p):
        a = _attn(p, x)
        return x + a, a

    x, ys = jax.lax.scan(body, x, ps)
    return jnp.mean(x**2) + jnp.mean(ys**2)


def _checkpointed(policy):
    def loss(ps, x):
        for i in range(2):
            x = jax.checkpoint(_layer, policy=policy)(jax.tree.map(lambda a, i=i: a[i], ps), x)
        return jnp.mean(x**2)

    return loss


_WS = _normal(33, (3, D, D)) * 0.3


def _scan_invariant_bias(x, b, w):
    def body(x, w):
        q = jnp.einsum("bthd,de->bthe", x, w)
        k = jnp.einsum("bthd,ed->bthe", x, w)
        return x + _att(q, k, jnp.tanh(x), bias=b), None

    return _sq(jax.lax.scan(body, x, w)[0])


def _scan_self_and_cross(x, mem, w):
    def body(x, w):
        q = jnp.einsum("bthd,de->bthe", x, w)
        k = jnp.einsum("bthd,ed->bthe", x, w)
        x = x + _att(q, k, jnp.tanh(x))
        return x + _att(jnp.tanh(x), mem, mem * 2), None

    return _sq(jax.lax.scan(body, x, w)[0])


def _grad_in_scan_body(w, xs):
    def body(acc, x):
        g = jax.grad(lambda w: _sq(_att(jnp.einsum("bthd,de->bthe", x, w), x, x)))(w)
        return acc + g, None

    return jax.lax.scan(body, jnp.zeros_like(w), xs)[0]


#: name -> (step, args, expected passes)
LAYERS = {
    "scan_reverse": (_sgd(_scanned(reverse=True)), (_params(2), _X), ["forward+backward"]),
    "scan_unroll_2": (_sgd(_scanned(unroll=2)), (_params(2), _X), ["forward+backward"]),
    "scan_length_1": (_sgd(_scanned()), (_params(1), _X), ["forward+backward"]),
    "scan_carries_attention_output": (_sgd(_carry_output), (_params(2), _X), ["forward+backward"]),
    "scan_returns_attention_output": (_sgd(_output_as_ys), (_params(2), _X), ["forward+backward"]),
    "scan_invariant_learned_bias": (
        _vg(_scan_invariant_bias),
        (_Q, _BIAS, _WS),
        ["forward+backward"],
    ),
    "scan_self_and_cross_attention": (
        _vg(_scan_self_and_cross),
        (_Q, _K, _WS),
        ["forward+backward"] * 2,
    ),
    "grad_inside_scan_body": (
        _grad_in_scan_body,
        (_W, _normal(30, (3, B, T, H, D))),
        ["forward+backward"],
    ),
    "remat_nothing_saveable": (
        _sgd(_checkpointed(jax.checkpoint_policies.nothing_saveable)),
        (_params(2), _X),
        ["forward"] * 2 + ["forward+backward"] * 2,
    ),
}


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_layers(name):
    step, args, passes = LAYERS[name]
    report = _run(step, *args, rtol=1e-4)  # several layers: f32 error compounds
    assert _passes(report) == passes, str(report)
    assert not report.fallbacks, str(report)


@pytest.mark.parametrize("policy", ["dots_saveable", "everything_saveable"])
def test_remat_policy_saving_the_scores(policy):
    # The remat body starts from the saved scores and recomputes the softmax: the
    # recompute is matched as the forward's twin (scans.Linked), the site rewritten.
    pol = getattr(jax.checkpoint_policies, policy)
    report = _run(_sgd(_checkpointed(pol)), _params(2), _X)
    assert _passes(report) == ["forward+backward"] * 2 and not report.fallbacks, str(report)


# ------------------------------------------------------------------ bugs found by this review


def _k_and_twice_k(q, m):
    return _sq(_att(q, m, 2 * m))


def _q_and_scaled_q(x, v):
    return _sq(_att(x, x * 1.5, v))


def _where_bias(q, k, v, b):
    s = jnp.einsum("bthd,bshd->bhts", q, k) / np.sqrt(D)
    s = jnp.where(b > 0, s + b, -1e9)
    return _sq(jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, -1), v))


def _isfinite_bias(q, k, v, b):
    s = jnp.einsum("bthd,bshd->bhts", q, k)
    s = jnp.where(jnp.isfinite(b), s + b, -1e9)
    return _sq(jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, -1), v))


DERIVED_OPERAND = {
    "v_is_2k": (_vg(_k_and_twice_k, (0, 1)), (_Q, _K)),
    "k_is_1.5q": (_vg(_q_and_scaled_q, (0, 1)), (_Q, _V)),
    "mask_is_bias_gt_0": (_vg(_where_bias, (0, 1, 2, 3)), (_Q, _K, _V, _BIAS)),
    "mask_is_isfinite_bias": (_vg(_isfinite_bias, (0, 1, 2, 3)), (_Q, _K, _V, _BIAS)),
}


# Once an internal error (KeyError): the equation between the two operands was taken
# into the forward and skipped, although the kernel reads its output.  The forward
# now stops at the values the kernel reads: v and 2k are independent operands of the
# site's vjp, autodiff's chain through the `mul` is outside it (backward._feeding).
@pytest.mark.parametrize("name", sorted(DERIVED_OPERAND))
def test_operand_derived_from_another_differentiated_operand(name):
    step, args = DERIVED_OPERAND[name]
    report = _run(step, *args)
    assert _passes(report) == ["forward+backward"], str(report)


def _temperature_per_layer(x, ts, w):
    def body(x, wt):
        w, t = wt
        q = jnp.einsum("bthd,de->bthe", x, w)
        k = jnp.einsum("bthd,de->bthe", x, w.T)
        return x + _att(q, k, jnp.tanh(x), scale=t), None

    return _sq(jax.lax.scan(body, x, (w, ts))[0])


def _cond_layer(ps, x):
    p = jax.tree.map(lambda a: a[0], ps)
    x = jax.lax.cond(x.sum() > 0, lambda x: _layer(p, x), lambda x: _layer(p, -x), x)
    return jnp.mean(x**2)


LOOP_BODY_MISSES = {
    "scan_learned_temperature_per_layer": (
        _vg(_temperature_per_layer),
        (_Q, jnp.array([0.3, 0.5, 0.7]), _WS),
    ),
    "cond_around_the_layer": (_sgd(_cond_layer), (_params(1), _X)),
}


# The reason says why the loop's backward was not proven (once: the forward body's
# "returned by the function", which the user never wrote).
@pytest.mark.parametrize("name", sorted(LOOP_BODY_MISSES))
def test_loop_body_fallback_reason(name):
    step, args = LOOP_BODY_MISSES[name]
    report = _run(step, *args, rtol=1e-4)
    assert report.fallbacks
    assert "returned by the function" not in _reasons(report), _reasons(report)


# Once kept with no reason at all (the policy's reduce_precision barriers hid
# the softmax); now the barriers are seen through and the site is rewritten.
def test_remat_everything_saveable_is_rewritten():
    step = _vg(
        lambda *a: _sq(jax.checkpoint(_att, policy=jax.checkpoint_policies.everything_saveable)(*a))
    )
    report = _run(step, _Q, _K, _V)
    assert _passes(report) == ["forward+backward"] and not report.fallbacks, str(report)


# When the forward's P·V is dead, the backward's dV = Pᵀ·dO product is what the
# probabilities feed: the reason says it may be that.
@pytest.mark.parametrize("how", ["checkpoint_attention_alone", "vjp_primal_unused"])
def test_dead_forward_reason(how):
    if how == "checkpoint_attention_alone":
        step = _vg(lambda *a: _sq(jax.checkpoint(_att)(*a)))
        args = (_Q, _K, _V)
    else:
        step = lambda q, k, v, ct: jax.vjp(_att, q, k, v)[1](ct)  # noqa: E731
        args = (_Q, _K, _V, _Q2)
    report = _run(step, *args)
    assert report.fallbacks
    assert "dV = Pᵀ·dO" in _reasons(report), _reasons(report)
