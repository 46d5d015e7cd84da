"""The two tiers: which parametrized cases of the large grids are `slow`.

The README's `python -m pytest -q` (the default set, ``-m "not slow"``) runs
every feature at least once within about 15 minutes on 2 cores; CI runs it
and the slow set (``-m slow``), so every case still runs in CI
(ci/README.md).  Most slow tests carry ``@pytest.mark.slow`` where they are
written.  The grids below cross a catalogue with another (every spelling of
tests/spellings.py in every first-call context, ...): their default set keeps
a sample chosen here by rule, so that every value of each axis the rule names
stays in it; tests/conftest.py marks the other cases `slow` at collection
(before ``-m`` selects), in the main session and in the 8-device one.

Rules (each names the test function by its file and name; a rule reads the
parameters' values in collection order, the i-th value of ``a`` being
``a = i``):

* ``diagonal(a, b)``: the cases with ``a % len(b) == b`` stay (each value of
  ``a`` once, each value of ``b`` about ``len(a) / len(b)`` times);
* ``every(k, a)``: the cases with ``a % k == 0`` stay;
* ``cover(a, ...)``: in collection order, a case stays when it brings a value
  of one of the named parameters (all of them, with none named) that no
  earlier kept case had: every value of each, in few cases;
* ``both(rule, ...)``: the cases every rule keeps.

A spelling (tests/spellings.py) is a feature: test_matching's
`test_spelling_is_rewritten_exactly` and test_golden keep every one, so the
other spelling grids keep a sample.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Diagonal:
    a: str
    b: str

    def keeps(self, cases: list[dict[str, int]], sizes: dict[str, int]) -> list[bool]:
        return [c[self.a] % sizes[self.b] == c[self.b] for c in cases]


@dataclasses.dataclass(frozen=True)
class Every:
    k: int
    a: str

    def keeps(self, cases, sizes) -> list[bool]:
        return [c[self.a] % self.k == 0 for c in cases]


@dataclasses.dataclass(frozen=True)
class Cover:
    names: tuple[str, ...]

    def keeps(self, cases, sizes) -> list[bool]:
        seen: set[tuple[str, int]] = set()
        out = []
        for c in cases:
            values = {(n, c[n]) for n in (self.names or tuple(c))}
            out.append(not values <= seen)
            seen |= values if out[-1] else set()
        return out


@dataclasses.dataclass(frozen=True)
class Both:
    rules: tuple

    def keeps(self, cases, sizes) -> list[bool]:
        kept = [True] * len(cases)
        for rule in self.rules:
            kept = [k and r for k, r in zip(kept, rule.keeps(cases, sizes), strict=True)]
        return kept


def diagonal(a: str, b: str) -> Diagonal:
    return Diagonal(a, b)


def every(k: int, a: str) -> Every:
    return Every(k, a)


def cover(*names: str) -> Cover:
    return Cover(names)


def both(*rules) -> Both:
    return Both(rules)


#: "file::function" -> the rule of its default-set sample.
SAMPLED = {
    # 53 spellings x 8 contexts: each spelling in one context, each context
    # with 6 or 7 spellings.
    "tests/test_contexts.py::test_first_call_in_context": diagonal("name", "context"),
    # Each spelling's training step (forward+backward rewrite): every third
    # spelling by default (the backward of each softmax form, mask and bias
    # kind is also in test_training's own tests and tests/test_mask_kinds.py).
    "tests/test_training.py::test_every_spelling": every(3, "name"),
    # The blockwise kernel on each spelling: every third (test_matching runs
    # every spelling through the reference kernel; tests/kernels the blockwise
    # kernel on every descriptor).
    "tests/test_kernel_integration.py::test_blockwise_end_to_end": every(3, "name"),
    # 8-device session: each spelling's batch-sharded first call, inside and
    # outside the user's shard_map: every third spelling, alternating.
    "tests/sharding/multidevice/test_shard_map_first_call.py::test_batch_sharded_first_call": both(
        diagonal("name", "optimize_outside"), every(3, "name")
    ),
    "tests/sharding/multidevice/test_ring.py::test_windowed_and_padded_rings": diagonal(
        "case", "kernel"
    ),
    "tests/sharding/multidevice/test_ring.py::test_sequence_sharded_site_runs_as_a_ring": cover(),
    "tests/sharding/multidevice/test_ring.py::test_ring_inside_the_users_shard_map": cover(),
    # Hugging Face decoders with and without a padding mask: each model once,
    # each mask kind on several models.
    "tests/models/test_transformers.py::test_decoder": diagonal("name", "padded"),
    "tests/test_sinks.py::test_sink_spellings_are_rewritten_forward_and_gradient": diagonal(
        "name", "kernel"
    ),
    # Each dropout spelling once, bfloat16 once.
    "tests/test_dropout.py::test_spelling_matches_the_original": cover(),
    # A Hugging Face training step with dropout: each model once, each dtype
    # once (the dropout spellings themselves: test_dropout.py).
    "tests/models/test_transformers_training.py::test_train_step_with_dropout": diagonal(
        "name", "dtype"
    ),
    # The bounded signature cache: one size by default (the eviction path runs
    # at size 1; size 8 repeats it with more entries).
    "tests/test_resources.py::test_cache_stays_bounded_and_releases_evicted_entries": every(
        2, "cache_size"
    ),
    # The torch-exported Llama fixtures: each attention implementation, each
    # exporter and each export route once.
    "tests/export/test_fixtures.py::test_llama_is_rewritten": cover(),
}


def mark(items, marker) -> list:
    """Add ``marker`` to the cases of `SAMPLED` functions outside their
    sample; the cases it marked."""
    groups: dict[str, list] = {}
    for item in items:
        key = item.nodeid.split("[")[0]
        if key in SAMPLED and hasattr(item, "callspec"):
            groups.setdefault(key, []).append(item)
    marked = []
    for key, group in groups.items():
        values: dict[str, list] = {}
        cases = []
        for item in group:
            case = {}
            for name, value in item.callspec.params.items():
                seen = values.setdefault(name, [])
                found = [i for i, v in enumerate(seen) if _same(value, v)]
                if not found:
                    seen.append(value)
                case[name] = found[0] if found else len(seen) - 1
            cases.append(case)
        sizes = {name: len(seen) for name, seen in values.items()}
        for item, kept in zip(group, SAMPLED[key].keeps(cases, sizes), strict=True):
            if not kept:
                item.add_marker(marker)
                marked.append(item)
    return marked


def _same(x, y) -> bool:
    if x is y:
        return True
    try:
        return bool(type(x) is type(y) and x == y)
    except Exception:
        return False
