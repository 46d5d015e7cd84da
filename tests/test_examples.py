"""The GPT example and its demo: rewrites found, numerics, exit status (quick sizes)."""

from __future__ import annotations

import functools
import math
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import flashpass  # noqa: E402
from examples import demo, gpt  # noqa: E402

QUICK = ["--quick", "--kernel", "blockwise", "--reps", "1"]


@pytest.fixture(scope="module")
def quick():
    """One in-process quick demo run with the kernel forced: ``(args, result, lines)``."""
    args = demo.parse_args(QUICK)
    lines: list[str] = []
    result = demo.run(args, log=lines.append)
    return args, result, lines


@pytest.fixture(scope="module")
def small():
    """Quick-size model and inputs (shared, so they are built once)."""
    args = demo.parse_args(["--quick"])
    cfg, params, tokens, train = demo.make_inputs(args)
    return cfg, params, tokens, train


def test_quick_demo_numerics_pass(quick):
    _, result, lines = quick
    text = "\n".join(lines)
    assert result.passed, text
    assert {c.name for c in result.checks} == {"logits", "loss", "grads", "scan logits"}
    for check in result.checks:
        assert check.rel_err <= check.rtol, text
    assert "numerics: PASS" in text


def test_quick_demo_rewrites_one_site_per_layer(quick):
    args, result, lines = quick
    report = result.report
    assert len(report.rewrites) == args.layers, "\n".join(lines)
    assert not report.fallbacks
    head_dim = args.d_model // args.heads
    for r in report.rewrites:
        assert r.kernel == "blockwise"
        assert r.causal and r.mask == "causal" and not r.bias
        assert r.q_shape == (args.batch, args.seq, args.heads, head_dim)
        assert math.isclose(r.scale, head_dim**-0.5, rel_tol=1e-6)
        assert r.scope == "top level"
        assert r.location and r.location.replace("\\", "/").split(":")[0].endswith(
            "examples/gpt.py"
        )
    # value_and_grad(loss_fn), optimized as a whole: the same sites, forward and backward.
    assert len(result.loss_report.rewrites) == args.layers
    assert all(r.backward for r in result.loss_report.rewrites)


def test_quick_demo_measures_every_variant(quick):
    _, result, lines = quick
    assert set(result.times) == set(demo.VARIANTS)
    assert all(t > 0 for t in result.times.values())
    assert all(isinstance(b, int) and b >= 0 for b in result.temp_bytes.values())
    assert result.rss == {}  # --quick implies --no-rss
    table = [line for line in lines if line.lstrip().startswith(demo.VARIANTS)]
    assert len(table) == len(demo.VARIANTS)


def test_main_exit_status_follows_numerics(monkeypatch):
    def fake_run(args, log=print):
        check = demo.Check("logits", 1.0, 1.0, demo.LOGITS_RTOL)
        return demo.Result(None, None, None, [check], {}, {}, {}, 0.0)

    monkeypatch.setattr(demo, "run", fake_run)
    assert demo.main(["--quick"]) == 1
    monkeypatch.setattr(
        demo,
        "run",
        lambda args, log=print: demo.Result(None, None, None, [], {}, {}, {}, 0.0),
    )
    assert demo.main(["--quick"]) == 0


def test_parse_args_quick_defaults_and_overrides():
    args = demo.parse_args(["--quick", "--layers", "3"])
    assert args.layers == 3 and args.seq == 128 and not args.rss and args.kernel is None
    full = demo.parse_args([])
    assert full.seq == 2048 and full.layers == 4 and full.rss


def test_forward_scan_attention_rewritten_inside_scan_body(small):
    cfg, params, tokens, _ = small
    stacked = gpt.stack_blocks(params)
    opt = flashpass.optimize(gpt.forward_scan, kernel="blockwise")
    report = opt.explain(stacked, tokens)
    assert len(report.rewrites) == 1  # one site, in the body shared by all layers
    assert not report.fallbacks
    assert "scan" in report.rewrites[0].scope
    assert report.rewrites[0].causal

    want = jax.jit(gpt.forward)(params, tokens)
    np.testing.assert_allclose(jax.jit(gpt.forward_scan)(stacked, tokens), want, atol=1e-5)
    np.testing.assert_allclose(jax.jit(opt)(stacked, tokens), want, atol=1e-5)


def test_default_kernel_declines_short_sequences(small):
    cfg, params, tokens, _ = small
    report = flashpass.optimize(gpt.forward).explain(params, tokens)
    assert not report.rewrites
    assert len(report.fallbacks) == cfg.n_layers
    assert all("short sequence" in f.reason for f in report.fallbacks)


def test_model_shapes_and_initial_loss(small):
    cfg, params, tokens, train = small
    logits = jax.jit(gpt.forward)(params, tokens)
    assert logits.shape == (*tokens.shape, cfg.vocab)
    loss = float(jax.jit(gpt.loss_fn)(params, train))
    # Random init: close to uniform over the vocabulary.
    assert abs(loss - math.log(cfg.vocab)) < 0.5


def test_untied_head():
    cfg = gpt.GPTConfig(vocab=32, d_model=32, n_heads=2, n_layers=1, max_len=16, tied=False)
    params = jax.eval_shape(functools.partial(gpt.init_params, cfg=cfg), jax.random.PRNGKey(0))
    assert params["head"].shape == (32, 32)
    tokens = jax.ShapeDtypeStruct((1, 16), np.int32)
    assert jax.eval_shape(gpt.forward, params, tokens).shape == (1, 16, 32)
    with pytest.raises(ValueError, match="divisible"):
        gpt.GPTConfig(d_model=30, n_heads=4)


def test_demo_header_and_rows_tell_what_ran(quick):
    """The header names the kernel choice (never ``kernel=None``); the rows of
    the layers, one attention function on one line, are told apart."""
    args, result, lines = quick
    assert not any("kernel=None" in line for line in lines)
    assert any(line.endswith("kernel: blockwise") for line in lines), lines[:3]
    layers = [r.layer for r in result.report.rewrites]
    assert len(set(layers)) == args.layers, layers
    assert all(layer.startswith("examples/gpt.py:") for layer in layers), layers
    # value_and_grad(loss_fn): the same layer names as the forward's
    assert [r.layer for r in result.loss_report.rewrites] == layers


def test_self_comparison_shows_no_ratio():
    """A pair with no site rewritten is one program: its ratios say ``same``."""
    ones = {v: 1.0 for v in demo.VARIANTS}
    rows = demo._table(ones, {v: 1 for v in demo.VARIANTS}, {}, ones, {"forward": True})
    forward = next(line for line in rows if "forward/flashpass" in line)
    assert "same" in forward and "x" not in forward.split("forward/flashpass")[1], forward
    trained = next(line for line in rows if "fwd+bwd/flashpass" in line)
    assert "1.00x" in trained, trained


@pytest.mark.slow  # a whole quick demo run
def test_quick_demo_without_a_kernel_claims_no_speed_up():
    args = demo.parse_args(["--quick", "--reps", "1"])
    lines: list[str] = []
    result = demo.run(args, log=lines.append)
    assert not result.report.rewrites  # the default order keeps short sequences
    text = "\n".join(lines)
    assert "kernel: the platform's default order" in text, text
    row = next(line for line in lines if "forward/flashpass" in line)
    assert "same" in row and "x " not in row + " ", row
    assert "noise only" in text
