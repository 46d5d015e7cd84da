"""Hugging Face Flax BERT and GPT-2 in training mode: attention dropout on.

``train=True`` turns every dropout in the model on: the attention
probabilities' (flax ``dot_product_attention_weights``, its keep-mask
broadcast over batch and heads) and the hidden states'.  The original and the
optimized function get the same dropout key, so they must compute the same
function: the kernel regenerates the program's own keep-mask per tile.

* Forward: every attention site is rewritten with its dropout (the threshold
  and the multiplier the program actually uses: ``1 / 0.9`` rounded to the
  model's dtype) and the logits equal the original's, for two keys (the key is
  read from the program, not baked in; the two outputs differ, so dropout is
  on).
* Train step: ``jax.value_and_grad`` of a cross-entropy loss, the dropout key
  split inside the step as the Hugging Face Flax example scripts do, the first
  call under ``jax.jit``.  Every site is rewritten forward and backward; the
  logits, the loss and the parameter gradients equal the original's.

bfloat16 (``dtype=jnp.bfloat16``, float32 parameters; the keep-mask is drawn
from float32 uniforms, so it is the float32 model's): the train step's logits,
loss and gradients, measured against the float32 model's, are within 1.5x the
original bf16 model's own error.
Tiny configs, random weights, nothing downloaded (see conftest.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashpass

tr = pytest.importorskip("transformers")
pytest.importorskip("flax")
if not hasattr(tr, "FlaxGPT2Model"):  # pragma: no cover - transformers >= 5
    pytest.skip("this transformers has no Flax models (need 4.57.x)", allow_module_level=True)

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

B, T, VOCAB, LAYERS = 2, 16, 128, 2
RATE = 0.1  # attention (and hidden) dropout: the libraries' default, set explicitly

#: float32 tolerance, relative to the largest magnitude of the logits or of the
#: whole gradient tree (measured on CPU: at most 5.3e-7 and 4.6e-7).
F32_TOL = 1e-5

MODELS = {
    # name: (model dir, class, config)
    "BERT": (
        "bert",
        "FlaxBertForMaskedLM",
        lambda: tr.BertConfig(
            hidden_size=32,
            num_hidden_layers=LAYERS,
            num_attention_heads=4,
            intermediate_size=64,
            vocab_size=VOCAB,
            max_position_embeddings=64,
            attention_probs_dropout_prob=RATE,
            hidden_dropout_prob=RATE,
        ),
    ),
    "GPT-2": (
        "gpt2",
        "FlaxGPT2LMHeadModel",
        lambda: tr.GPT2Config(
            n_embd=32,
            n_layer=LAYERS,
            n_head=4,
            n_positions=64,
            vocab_size=VOCAB,
            attn_pdrop=RATE,
            resid_pdrop=RATE,
            embd_pdrop=RATE,
        ),
    ),
}
DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16}


def _ids(seed):
    return jnp.asarray(np.random.default_rng(seed).integers(0, VOCAB, (B, T)), jnp.int32)


def _padding():
    """Second example padded: [[1]*T, [1]*10 + [0]*(T-10)]."""
    return jnp.asarray(np.arange(T)[None, :] < np.array([T, 10])[:, None], jnp.int32)


@functools.cache
def _model(name, dtype_name):
    _, cls_name, config = MODELS[name]
    return getattr(tr, cls_name)(config(), _do_init=False, dtype=DTYPES[dtype_name])


def _params(model, random_params):
    # float32 whatever the model's dtype: the bf16 and f32 models share them.
    init = functools.partial(model.init_weights, input_shape=model.input_shape)
    return random_params(init, jax.random.PRNGKey(0))


def _logits(model):
    def fn(params, ids, mask, key):
        return model(ids, attention_mask=mask, params=params, dropout_rng=key, train=True).logits

    return fn


def _train_step(model):
    """One step of a Hugging Face Flax example script, less the optimizer: the
    dropout key split, the loss and its gradients, the next key (and the
    logits, to compare the forward too)."""

    def step(params, ids, mask, labels, key):
        key, dropout_key = jax.random.split(key)

        def loss(params):
            logits = _logits(model)(params, ids, mask, dropout_key)
            logp = jax.nn.log_softmax(logits.astype(jnp.float32))
            nll = -jnp.take_along_axis(logp, labels[..., None], -1)[..., 0]
            return jnp.sum(nll * mask) / jnp.sum(mask), logits

        (value, logits), grads = jax.value_and_grad(loss, has_aux=True)(params)
        return value, logits, grads, key

    return step


def _check_sites(report, name, dtype):
    assert not report.fallbacks and len(report.rewrites) == LAYERS, str(report)
    model_dir = MODELS[name][0]
    divisor = jnp.asarray(1 - RATE, dtype)
    multiplier = float(jnp.asarray(1, dtype) / divisor)  # 1.109375 in bfloat16
    for r in report.rewrites:
        assert r.kernel == "blockwise", str(report)
        loc = (r.location or "").replace("\\", "/")
        assert f"transformers/models/{model_dir}/modeling_flax_{model_dir}.py" in loc, loc
        (dropout,) = [op for op in r.spec["score_ops"] if op["op"] == "dropout"]
        # flax's broadcast_dropout: one [T, S] keep-mask for every example and head.
        assert tuple(dropout["mask_shape"]) == (1, 1, T, T), dropout
        assert dropout["threshold"] == pytest.approx(1 - RATE) and dropout["keep_below"]
        # bernoulli(key, 0.9, shape) draws float32 uniforms whatever the model's dtype.
        assert dropout["uniform_dtype"] == "float32" and dropout["bits"] == 32, dropout
        assert dropout["scale"] == multiplier, dropout


def _max_err(actual, expected) -> float:
    return max(
        float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(e, np.float32))))
        for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True)
    )


def _top(tree) -> float:
    return max(float(np.max(np.abs(np.asarray(x, np.float32)))) for x in jax.tree.leaves(tree))


def _assert_tree_close(actual, expected, tol, name):
    """Every leaf within ``tol`` x the largest magnitude in the whole tree: a
    leaf whose exact value is zero (the key bias's gradient: softmax ignores
    per-row constants) holds only rounding noise, so no leaf is compared to its
    own scale alone."""
    err, top = _max_err(actual, expected), _top(expected)
    assert err <= tol * top, f"{name}: max error {err:.3g} > {tol:g} x {top:.3g}"


# --------------------------------------------------------------------------- forward


@pytest.mark.parametrize("name", list(MODELS))
def test_forward_with_dropout(random_params, record_coverage, name):
    # float32; the train steps below check the bfloat16 logits too.
    model = _model(name, "f32")
    params = _params(model, random_params)
    fn = _logits(model)
    ids, mask = _ids(0), _padding()
    keys = jax.random.PRNGKey(3), jax.random.PRNGKey(4)

    opt = flashpass.optimize(fn, kernel="blockwise")
    report = opt.explain(params, ids, mask, keys[0])
    case = f"{name}, train=True (attention dropout {RATE}), padding mask"
    record_coverage(report, library="transformers", case=case, sites=LAYERS)
    _check_sites(report, name, jnp.float32)

    run_opt, run_ref = jax.jit(opt), jax.jit(fn)
    outs = []
    for key in keys:
        got, want = run_opt(params, ids, mask, key), run_ref(params, ids, mask, key)
        assert got.dtype == want.dtype == jnp.float32
        _assert_tree_close(got, want, F32_TOL, "logits")
        outs.append(want)
    # Dropout is on: another key, other logits.
    assert _max_err(outs[0], outs[1]) > 0.05 * _top(outs[0])


# --------------------------------------------------------------------------- train step


_REFERENCE: dict = {}


def _reference_step(name, dtype, params):
    """The original step's loss, logits and gradients, once per model and dtype
    (the bf16 test compares against the float32 model's too).  ``params`` are
    the same for every dtype and test (seeded)."""
    if (name, dtype) not in _REFERENCE:
        step = _train_step(_model(name, dtype))
        _REFERENCE[name, dtype] = jax.jit(step)(params, *_step_inputs())[:3]
    return _REFERENCE[name, dtype]


def _step_inputs():
    return _ids(0), _padding(), _ids(1), jax.random.PRNGKey(5)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("name", list(MODELS))
def test_train_step_with_dropout(random_params, record_coverage, name, dtype):
    model = _model(name, dtype)
    params = _params(model, random_params)
    step = _train_step(model)

    opt = flashpass.optimize(step, kernel="blockwise")
    value, logits, grads, next_key = jax.jit(opt)(params, *_step_inputs())  # first call: jit
    report = opt.reports[-1]
    case = f"{name}, train=True, value_and_grad train step, {dtype}"
    record_coverage(report, library="transformers", case=case, sites=LAYERS)
    _check_sites(report, name, DTYPES[dtype])
    assert [r.passes for r in report.rewrites] == ["forward+backward"] * LAYERS, str(report)
    np.testing.assert_array_equal(next_key, jax.random.split(_step_inputs()[-1])[0])

    ref_value, ref_logits, ref_grads = _reference_step(name, dtype, params)
    assert logits.dtype == ref_logits.dtype == DTYPES[dtype]
    if dtype == "f32":
        _assert_tree_close(logits, ref_logits, F32_TOL, "logits")
        np.testing.assert_allclose(value, ref_value, rtol=F32_TOL)
        _assert_tree_close(grads, ref_grads, F32_TOL, "grads")
        return
    # bfloat16 logits, losses and gradients are far from exact either way:
    # against the float32 model's (same parameters, same keep-mask), the
    # rewrite's error is within the original's own.
    truth_value, truth_logits, truth = _reference_step(name, "f32", params)
    for what, got, want, truth_ in [
        ("logits", logits, ref_logits, truth_logits),
        ("loss", value, ref_value, truth_value),
        ("grads", grads, ref_grads, truth),
    ]:
        err, ref_err = _max_err(got, truth_), _max_err(want, truth_)
        assert err <= 1.5 * ref_err + 1e-3 * _top(truth_), (what, err, ref_err, _top(truth_))
