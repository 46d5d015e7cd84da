"""Docs stay in sync with the code."""

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _miss_reasons():
    """Literal fragments of every `Miss(...)` reason in the matcher."""
    files = sorted((ROOT / "patterns").glob("*.py")) + [ROOT / "flashpass" / "pipeline.py"]
    found = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Miss"):
                continue
            if any(k.arg == "relevant" for k in node.keywords):
                continue  # silent misses (not a softmax at all) are never reported
            arg = node.args[0] if node.args else None
            if isinstance(arg, ast.Constant):
                parts = [arg.value]
            elif isinstance(arg, ast.JoinedStr):
                parts = [v.value for v in arg.values if isinstance(v, ast.Constant)]
            else:
                continue  # a computed reason (e.g. soft-cap) is listed by hand below
            fragment = max(parts, key=len).strip(" `")
            found.append((path.name, fragment))
    return found


def test_troubleshooting_lists_every_reason():
    doc = (ROOT / "docs" / "troubleshooting.md").read_text()
    flat = re.sub(r"\s+", " ", doc)
    missing = []
    for name, fragment in _miss_reasons():
        words = fragment.split(": ")[0].split("; ")[0]
        if len(words) >= 6 and words not in flat:
            missing.append(f"{name}: {words!r}")
    for literal in (
        "tanh on the scores is not a soft-cap",
        "short sequence",
        "interpret=True",
        "while tracing/lowering",
        "rewriting the enclosing body failed",
    ):
        if literal not in flat:
            missing.append(literal)
    assert not missing, "docs/troubleshooting.md lacks:\n" + "\n".join(missing)


def _readme_block(heading: str) -> str:
    """The first ```python block after ``heading`` in README.md."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index(heading) :]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


def test_readme_testing_example_runs_as_written(tmp_path, monkeypatch):
    """The "Testing your model" example, at its test sizes (seq 256): its first
    run writes the golden file and says so, the next passes against it, an
    update run names the file it rewrote, and under CI a missing file is an
    error saying how to create it."""
    import pytest

    from flashpass.testing import GoldenWritten

    code = _readme_block("## Testing your model")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.delenv("FLASHPASS_UPDATE_GOLDENS", raising=False)
    with pytest.warns(GoldenWritten, match="created golden file tests/golden/model.txt"):
        exec(compile(code, "README.md", "exec"), {})
    golden = (tmp_path / "tests" / "golden" / "model.txt").read_text()
    assert "# rewrites: 1 (blockwise)" in golden
    exec(compile(code, "README.md", "exec"), {})  # passes against it, writes nothing
    assert (tmp_path / "tests" / "golden" / "model.txt").read_text() == golden
    monkeypatch.setenv("FLASHPASS_UPDATE_GOLDENS", "1")
    with pytest.warns(GoldenWritten, match=r"updated golden file tests/golden/model.txt \(rewr"):
        exec(compile(code, "README.md", "exec"), {})
    monkeypatch.delenv("FLASHPASS_UPDATE_GOLDENS")
    (tmp_path / "tests" / "golden" / "model.txt").unlink()
    monkeypatch.setenv("CI", "true")
    with pytest.raises(AssertionError, match="FLASHPASS_UPDATE_GOLDENS=1 python -m pytest"):
        exec(compile(code, "README.md", "exec"), {})


def test_assert_rewrites_kernel_chooses_the_kernel():
    """At seq 256 the default order keeps the site; ``kernel=`` on a plain
    function chooses the kernel, on an optimized one it only checks."""
    import jax
    import jax.numpy as jnp
    import pytest

    import flashpass
    from flashpass.testing import assert_rewrites

    def attention(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(q.shape[-1])
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)

    q = k = v = jnp.ones((1, 256, 4, 32))
    assert not flashpass.explain(attention, q, k, v).rewrites  # the premise
    report = assert_rewrites(attention, q, k, v, count=1, kernel="blockwise")
    assert report.kernels == ["blockwise"]
    with pytest.raises(AssertionError, match="optimized with kernel=None, so"):
        assert_rewrites(flashpass.optimize(attention), q, k, v, kernel="blockwise")
    with pytest.raises(TypeError, match="differ"):
        assert_rewrites(
            attention, q, k, v, kernel="blockwise", optimize_kwargs={"kernel": "reference"}
        )


def test_blockwise_kernel_importable():
    from flashpass.kernels import BlockwiseKernel, get_kernel

    assert isinstance(get_kernel("blockwise"), BlockwiseKernel)


def test_logging_recipe_shows_flashpass_lines_only(capsys):
    """docs/report.md's logging block: the flashpass lines reach stderr, once the
    program runs (not on explain), and nothing of JAX's."""
    import logging

    import jax
    import jax.numpy as jnp

    import flashpass

    text = (ROOT / "docs" / "report.md").read_text()
    section = text[text.index("## Logging") :]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    log = logging.getLogger("flashpass")
    saved = (log.level, log.propagate, list(log.handlers))
    try:
        exec(compile(code, "docs/report.md", "exec"), {})

        def attention(q, k, v):
            s = jnp.einsum("bqhd,bkhd->bhqk", q, k)
            return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)

        q = jnp.ones((1, 16, 2, 8))
        opt = flashpass.optimize(attention, kernel="blockwise")
        opt.explain(q, q, q)
        assert capsys.readouterr().err == ""
        jax.jit(opt)(q, q, q)
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and "attention: rewrote attention at" in lines[0], lines
    finally:
        log.setLevel(saved[0])
        log.propagate = saved[1]
        log.handlers[:] = saved[2]


def test_doc_pages_are_linked_from_the_readme():
    readme = (ROOT / "README.md").read_text()
    for page in ("docs/nnx.md", "docs/report.md"):
        assert f"]({page})" in readme and (ROOT / page).exists(), page


# ------------------------------------------------------------------ every code block runs


def _python_blocks() -> dict:
    """``{(page, n): code}``: the n-th fenced ```python block of README.md and
    of each page of docs/."""
    found = {}
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = path.read_text()
        blocks = re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)
        for n, code in enumerate(blocks):
            found[(path.relative_to(ROOT).as_posix(), n)] = code
    return found


_NNX_SETUP = """
import jax
import jax.numpy as jnp
from flax import nnx


class MyModel(nnx.Module):  # causal self-attention
    def __init__(self, rngs):
        self.qkv = nnx.Linear(32, 96, rngs=rngs)
        self.out = nnx.Linear(32, 32, rngs=rngs)

    def __call__(self, x):
        b, t, d = x.shape
        q, k, v = jnp.split(self.qkv(x).reshape(b, t, 12, 8), 3, axis=2)
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(8.0)
        s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -jnp.inf)
        p = jax.nn.softmax(s, axis=-1)
        return self.out(jnp.einsum("bhqk,bkhd->bqhd", p, v).reshape(b, t, d))


x0 = jax.random.normal(jax.random.key(1), (2, 16, 32))
batches = [(x0, jnp.sin(x0))] * 2
"""

_NNX_CHECK = """
report = train_step.explain(model, optimizer, x, y)
assert isinstance(report, flashpass.Report) and len(train_step.reports) == 1, report
assert train_step.reports[-1] is report
other = flashpass.optimize(nnx.jit(step))  # the other order keeps them too
other(model, optimizer, x, y)
assert isinstance(other.explain(model, optimizer, x, y), flashpass.Report)
assert len(other.reports) == 1
"""

_SHARDING_SETUP = """
import jax
import flashpass
from examples.sharded import block, make_inputs, shard

params, x = make_inputs()
"""

_STABLEHLO_SETUP = """
import jax
import jax.numpy as jnp


def attention(q, k, v):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.125
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


q = jax.ShapeDtypeStruct((1, 64, 2, 16), jnp.float32)
open("model.bin", "wb").write(jax.export.export(jax.jit(attention))(q, q, q).serialize())
"""

#: What each block uses without defining it (supplied here, never by editing
#: the page), and what is checked after it ran.
DOC_BLOCKS = {
    ("README.md", 0): ("", "assert out.shape == q.shape"),
    ("README.md", 1): ("", "import os; assert os.path.exists(golden)"),
    ("docs/nnx.md", 0): (_NNX_SETUP, _NNX_CHECK),
    ("docs/report.md", 0): ("", "assert log.handlers"),
    ("docs/sharding.md", 0): (_SHARDING_SETUP, "assert y.shape == x.shape"),
    ("docs/stablehlo.md", 0): (_STABLEHLO_SETUP, "assert new.in_avals == exp.in_avals"),
}


def test_every_doc_block_is_run():
    """A new ```python block in README.md or docs/ gets its entry in DOC_BLOCKS."""
    assert set(_python_blocks()) == set(DOC_BLOCKS)


def _run_block(where, tmp_path):
    import os
    import subprocess
    import sys

    setup, check = DOC_BLOCKS[where]
    code = _python_blocks()[where]
    script = tmp_path / "block.py"
    script.write_text(f"{setup}\n{code}\n{check}\n")
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "FLASHPASS_UPDATE_GOLDENS")}
    env.update(
        JAX_PLATFORMS="cpu",
        XLA_FLAGS="--xla_force_host_platform_device_count=8",
        PYTHONPATH=str(ROOT),
    )
    return subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True
    )


@pytest.mark.slow  # a fresh interpreter per block (JAX, Flax, a model)
@pytest.mark.parametrize("where", sorted(DOC_BLOCKS), ids=lambda w: f"{w[0]}#{w[1]}")
def test_doc_block_runs_as_written(where, tmp_path):
    proc = _run_block(where, tmp_path)
    assert proc.returncode == 0, f"{where}:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    if where == ("README.md", 1):  # the first run wrote the golden file; the next passes
        assert "created golden file tests/golden/model.txt" in proc.stderr, proc.stderr
        again = _run_block(where, tmp_path)
        assert again.returncode == 0 and "golden file" not in again.stderr, again.stderr


def test_readme_states_the_demo_time():
    """The demo command's paragraph says how long it takes."""
    readme = (ROOT / "README.md").read_text()
    intro = readme[: readme.index("python examples/demo.py")]
    assert re.search(r"about 3 minutes", intro), intro
