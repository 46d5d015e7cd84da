"""What a new user meets: the off switch, option typos, platform names, the
lazy ``flashpass.export``, and what the report says about each row."""

from __future__ import annotations

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashpass
from flashpass.platforms import export_platform, kernel_platform


def attention(q, k, v):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(q.shape[-1])
    s = jnp.where(jnp.tril(jnp.ones((q.shape[1], k.shape[1]), bool)), s, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


def exported_attention(q, k, v):
    """`attention` with a literal scale (what export tests lift)."""
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.35
    s = jnp.where(jnp.tril(jnp.ones((q.shape[1], k.shape[1]), bool)), s, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


Q = jnp.asarray(np.random.default_rng(0).standard_normal((1, 32, 2, 8)), jnp.float32)


# ------------------------------------------------------------------ 5. the off switch


def test_disable_env_makes_optimize_an_identity_over_jit(monkeypatch):
    monkeypatch.setenv("FLASHPASS_DISABLE", "1")
    opt = flashpass.optimize(attention, kernel="blockwise")
    report = opt.explain(Q, Q, Q)
    assert report.disabled == "FLASHPASS_DISABLE=1" and not report.rewrites
    assert str(report).startswith("flashpass report (cpu): disabled (FLASHPASS_DISABLE=1)")
    assert report.to_dict()["disabled"] == "FLASHPASS_DISABLE=1"
    # the program is the original's: no kernel call, the same values as jax.jit
    assert "flashpass_" not in str(opt.rewritten_jaxpr(Q, Q, Q))
    np.testing.assert_array_equal(opt(Q, Q, Q), jax.jit(attention)(Q, Q, Q))

    class Layer:
        @flashpass.optimize(kernel="blockwise")
        def __call__(self, q):
            return attention(q, q, q)

    layer = Layer()
    monkeypatch.setenv("FLASHPASS_DISABLE", "0")  # read when optimize was called
    assert opt.explain(Q, Q, Q * 2).disabled and layer.__call__.explain(Q).disabled
    assert flashpass.optimize(attention, kernel="blockwise").explain(Q, Q, Q).rewrites


# ------------------------------------------------------------------ 6. typos


def test_unknown_option_lists_every_option_and_suggests_one():
    with pytest.raises(TypeError) as err:
        flashpass.optimize(attention, kernal="blockwise")
    text = str(err.value)
    assert "'kernal' (did you mean 'kernel'?)" in text, text
    for name in (
        "kernel",
        "platform",
        "interpret",
        "static_argnums",
        "static_argnames",
        "cache_size",
        "strict",
        "zigzag",
    ):
        assert f"{name}:" in text, (name, text)
    with pytest.raises(TypeError, match=r"'platfrom' \(did you mean 'platform'\?\)"):
        flashpass.optimize(attention, platfrom="cpu")


# ------------------------------------------------------------------ 4. one platform vocabulary


def test_platform_aliases_in_optimize():
    for alias in ("cuda", "rocm", "gpu"):
        opt = flashpass.optimize(attention, platform=alias, kernel="reference")
        assert opt._platform == "gpu"
        assert opt.explain(Q, Q, Q).platform == "gpu"
    assert kernel_platform("cpu") == "cpu"
    with pytest.raises(ValueError, match="aliases: 'cuda' and 'rocm'"):
        kernel_platform("vax")


def test_platform_aliases_in_export():
    assert export_platform("gpu", ("cpu", "rocm")) == "rocm"
    assert export_platform("gpu", ("cuda",)) == "cuda"
    assert export_platform("gpu", ("cpu",), host="cuda") == "cuda"
    assert export_platform("tpu", ("cpu",)) == "tpu"
    with pytest.raises(ValueError, match="name 'cuda' or 'rocm'"):
        export_platform("gpu", ("cpu",), host="cpu")
    with pytest.raises(ValueError, match="name 'cuda' or 'rocm'"):
        export_platform("gpu", ("cuda", "rocm"))
    exp = jax.export.export(jax.jit(exported_attention), platforms=("cpu", "cuda"))(Q, Q, Q)
    report = flashpass.export.explain(exp, platforms=("gpu",), kernel="reference")
    assert report.platforms == ("cuda",), report


# ------------------------------------------------------------------ 7. flashpass.export


@pytest.mark.slow  # a fresh interpreter
def test_export_is_reachable_lazily():
    code = (
        "import sys, flashpass\n"
        "assert 'flashpass.export' not in sys.modules, 'imported eagerly'\n"
        "assert callable(flashpass.export.load)\n"
        "assert 'flashpass.export' in sys.modules\n"
        "try:\n    flashpass.nothing\nexcept AttributeError as e:\n    print(e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={"JAX_PLATFORMS": "cpu"}
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "has no attribute 'nothing'" in out.stdout


# ------------------------------------------------------------------ 2. what each row says


def _key_padded(q, k, v, keep):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k)
    bias = jax.lax.select(
        jnp.broadcast_to(keep[:, None, None, :], s.shape) > 0,
        jnp.zeros_like(s),
        jnp.full_like(s, jnp.finfo(s.dtype).min),
    )
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s + bias, axis=-1), v)


def test_mask_column_names_what_the_kernel_received():
    keep = jnp.ones((1, 32), jnp.int32).at[0, 20:].set(0)
    report = flashpass.explain(flashpass.optimize(_key_padded, kernel="blockwise"), Q, Q, Q, keep)
    (r,) = report.rewrites
    assert r.mask == "key mask", str(report)  # an O(B·S) operand, not a dense mask

    dense = np.random.default_rng(1).random((32, 32)) > 0.3
    dense[:, 0] = True

    def fn(q, k, v):
        s = jnp.where(jnp.asarray(dense), jnp.einsum("bqhd,bkhd->bhqk", q, k), -1e9)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)

    assert flashpass.explain(flashpass.optimize(fn, kernel="blockwise"), Q, Q, Q).kernels
    (r,) = flashpass.optimize(fn, kernel="blockwise").explain(Q, Q, Q).rewrites
    assert r.mask == "dense"


def test_rows_of_a_loop_are_distinguishable():
    def model(q):
        for _ in range(3):
            q = attention(q, q, q)
        return q

    report = flashpass.optimize(model, kernel="blockwise").explain(Q)
    layers = [r.layer for r in report.rewrites]
    assert len(layers) == 3 and len(set(layers)) == 3, layers
    assert [layer.rsplit(" ", 1)[1] for layer in layers] == ["#1", "#2", "#3"]
    assert all(layer.startswith("tests/test_front_ends.py:") for layer in layers), layers


def test_training_step_layers_keep_the_outer_scope():
    def forward(q):
        with jax.named_scope("Model"), jax.named_scope("attn"):
            return attention(q, q, q)

    step = jax.value_and_grad(lambda q: jnp.sum(forward(q)))
    fwd = flashpass.optimize(forward, kernel="blockwise").explain(Q).rewrites[0].layer
    (r,) = flashpass.optimize(step, kernel="blockwise").explain(Q).rewrites
    assert r.backward and r.layer == fwd == "Model/attn", (r.layer, fwd)


def test_export_report_points_at_the_artifacts_locations():
    exp = jax.export.export(jax.jit(exported_attention))(Q, Q, Q)
    report = flashpass.export.explain(exp, kernel="blockwise")
    (r,) = report.rewrites
    assert r.location.endswith(".py:" + r.location.rsplit(":", 1)[1])
    assert "test_front_ends.py" in r.location, r.location  # where the exporter wrote it
    text = str(report)
    assert "flashpass/export" not in text and "ops.py" not in text, text

    def two(q, k, v):
        for _ in range(2):
            q = exported_attention(q, k, v)
        return q

    twice = flashpass.export.explain(jax.export.export(jax.jit(two))(Q, Q, Q), kernel="blockwise")
    layers = [r.layer for r in twice.rewrites]
    assert len(set(layers)) == 2 and layers[0].endswith(" #1"), layers
    _, spliced = flashpass.export.rewrite_and_explain(exp, route="splice", kernel="blockwise")
    assert spliced.route == "splice" and spliced.rewrites[0].location == r.location, spliced

    # MLIR text without locations: the line of the text; unknown locations: says so
    text = _strip_locations(exp.mlir_module(), "")
    (r,) = flashpass.export.explain(flashpass.export.load(text), kernel="blockwise").rewrites
    assert r.location.startswith("module text:"), r
    line = int(r.location.split(":")[1])
    assert "dot_general" in text.splitlines()[line - 1], (line, text)
    unknown = flashpass.export.load(_strip_locations(exp.mlir_module(), " loc(unknown)"))
    report = flashpass.export.explain(unknown, kernel="blockwise")
    (r,) = report.rewrites
    assert r.location is None and r.layer == "no location in the artifact", r
    assert "ops.py" not in str(report) and "no location in the artifact" in str(report)


def test_export_dense_notes_name_no_lifter_line():
    # A learned bias beside a length mask keeps the mask dense (the bias is
    # unbounded); the note says where from the artifact's side, never the
    # lifter's own rule that built the add.
    def biased(q, k, v, bias, lengths):
        s = jnp.einsum("bhtd,bhsd->bhts", q, k) / 4.0
        keep = jnp.arange(s.shape[-1])[None, :] < lengths[:, None]
        s = s + bias[None]
        s = s + jnp.where(keep, 0.0, -1e9)[:, None, None, :]
        return jnp.einsum("bhts,bhsd->bhtd", jax.nn.softmax(s, -1), v)

    t = Q.shape[2]
    bias = jnp.zeros((Q.shape[1], t, t), Q.dtype)
    lengths = jnp.full((Q.shape[0],), t, jnp.int32)
    exp = jax.export.export(jax.jit(biased))(Q, Q, Q, bias, lengths)
    report = flashpass.export.explain(exp, kernel="blockwise")
    (r,) = report.rewrites
    assert r.dense and all(note.endswith("at the lifted module") for note in r.dense), r.dense
    assert "flashpass/export" not in str(report) and "ops.py" not in str(report), str(report)


def _strip_locations(text: str, replacement: str) -> str:
    import re

    lines = [line for line in text.splitlines() if not line.startswith("#loc")]
    return re.sub(r" loc\([^\n]*\)$", replacement, "\n".join(lines), flags=re.M)
