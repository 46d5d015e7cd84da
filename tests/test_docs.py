"""Docs stay in sync with the code."""

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _miss_reasons():
    """Literal fragments of every `Miss(...)` reason in the matcher."""
    files = sorted((ROOT / "patterns").glob("*.py")) + [
        ROOT / "flashpass" / name for name in ("match.py", "backward.py", "scans.py", "pipeline.py")
    ]
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
    """The "Testing your model" example, at its test sizes (seq 256): it
    writes its golden file once, then passes against it."""
    code = _readme_block("## Testing your model")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FLASHPASS_UPDATE_GOLDENS", "1")
    exec(compile(code, "README.md", "exec"), {})
    golden = (tmp_path / "tests" / "golden" / "model.txt").read_text()
    assert "# rewrites: 1 (blockwise)" in golden
    monkeypatch.delenv("FLASHPASS_UPDATE_GOLDENS")
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
