"""The protocol every score op follows: its semantics, stated once.

A score op is a frozen dataclass (the spec's contract, `flashpass.spec`) that
also answers, for every consumer, what it means:

* `ScoreOp.apply`: the op on a block of scores (the reference, blockwise tiles);
* `KeepOp.keep`: which (query, key) entries a key-excluding op keeps;
* `Positional.key_ranges`: the keys a row keeps as half-open ranges, from
  which `tile_state` (which tiles are empty or full) follows;
* `ScoreOp.at_offset`: the op in the local positions of a ring step;
* `ScoreOp.localized`: the op on one shard (batch and heads divided);
* `ScoreOp.row_keys`, `ScoreOp.meets_block`, `ScoreOp.empties_a_row`,
  `ScoreOp.key_counts` and ``keeps_first_key``: what a ring (`flashpass.ring`)
  may skip, and which extras it shifts to a visiting K/V block;
* `ScoreOp.extras_read`, `ScoreOp.final_score`, and class attributes for the
  descriptor names, report word and decline-reason words.

Each kind names its ``stage``: a score op proper (``"scores"``), the
softmax's normaliser (`Sink`), an op on the probabilities (`Dropout`), or the
rows a mask empties (`EmptyRows`, a combinator: it names the kernels module
that runs a spec holding it as two kernel calls, `combinator`); the spec
keeps each stage in a field of its own.  Consumers loop over a spec's ops and
ask; none switches on the kind.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp
import numpy as np

#: `ScoreOp.at_offset`'s answer for an op that excludes every key of the block.
EXCLUDED = "excluded"


class Positions:
    """The query and key positions of a score block ``[..., rows, cols]``.

    ``q``/``k`` are 1-D (made on first use, unless given); `grid` broadcasts
    them.  ``transposed``: the block is ``[..., keys, queries]`` and the
    positions come as the blockwise backward passes them (rows ``-k_pos``,
    columns ``-q_pos``, see `flashpass.kernels.blockwise.tiles.tile_score_fn`).
    """

    def __init__(self, shape, q_pos=None, k_pos=None, transposed=False, kv_len=None):
        self.shape, self._q, self._k = shape, q_pos, k_pos
        self.transposed, self.kv_len = transposed, kv_len

    @property
    def q(self):
        if self._q is None:
            self._q = jnp.arange(self.shape[-2])
        return self._q

    @property
    def k(self):
        if self._k is None:
            self._k = jnp.arange(self.shape[-1])
        return self._k

    def grid(self):
        """``(qi, kj)``: each entry's query and key position, broadcastable."""
        q, k = self.q, self.k
        if self.transposed:  # rows are keys at -k, columns queries at -q
            return -k[None, :], -q[:, None]
        return q[:, None], k[None, :]


class ScoreOp:
    """Base of every score-op kind (`flashpass.ops.KINDS`); the defaults are
    those of an op that changes no score and reads nothing."""

    #: Descriptor names this kind may report (`AttentionSpec.descriptors`), with
    #: the words docs/kernels.md shows; `descriptor` picks one per op.
    descriptors_doc: ClassVar[dict[str, str]] = {}
    #: The word naming it in a rewrite's ``mask`` report field (None: not a mask).
    word: ClassVar[str | None] = None
    #: How a kernel's decline reason names it (structured kinds).
    reason_words: ClassVar[str | None] = None
    #: What the 'blockwise' kernel does with it instead, for that reason.
    reason_hint: ClassVar[str] = "takes it as a descriptor and skips the blocks it excludes"
    #: Excludes keys by position or segment id (`flashpass.spec.STRUCTURED`), so
    #: a kernel may skip whole blocks it excludes.
    structured: ClassVar[bool] = False
    #: Maps every score alike (Scale, Softcap) or leaves the scores alone
    #: (Dropout, Sink): keys excluded before it still share one final score.
    uniform: ClassVar[bool] = False
    #: Which `AttentionSpec` stage holds it: "scores" (``score_ops``),
    #: "rows" (``empty_rows``), "normaliser" (``sink``) or "probabilities"
    #: (``dropout``).
    stage: ClassVar[str] = "scores"
    #: A constant every score is multiplied by (`Scale`), else None.
    multiplier: ClassVar[float | None] = None
    #: A combinator (an op no kernel sees: a spec holding it runs as several
    #: calls of one kernel) names the module of `flashpass.kernels` that runs
    #: it (`flashpass.kernels.combine`); None: the kernels apply the op.
    combinator: ClassVar[str | None] = None
    #: The op never takes a row's first key (key 0) from it: it excludes no
    #: key by data and, by position, only later ones (kv lengths: where each
    #: is at least 1, which a ring checks at run time, `empties_a_row`).  A
    #: ring with kv lengths skips a block past every row's length only where
    #: every op says so (`flashpass.ring.step`); False where unsure (a bias
    #: may hold -inf).
    keeps_first_key: ClassVar[bool] = False

    def report_word(self, spec) -> str | None:
        """The word naming this op in a rewrite's ``mask`` field (`word`; a
        kind whose operand's shape decides, `Mask`, overrides it)."""
        return self.word

    def descriptor(self, spec) -> str | None:
        """The descriptor this op gives ``spec`` (None: plain attention)."""
        return next(iter(self.descriptors_doc), None)

    def extras_read(self) -> tuple[int, ...]:
        """Indices of the extras the op reads."""
        return ()

    def grad_extras(self) -> tuple[int, ...]:
        """Indices of the float extras the scores depend on differentiably
        (a bias, slopes): their cotangents are the tile sums of ``dS``."""
        return ()

    def final_score(self, value: float) -> float:
        """What the op makes of an excluded key's score ``value`` (float64 numpy):
        the step of `flashpass.spec.fill_after`."""
        return value

    def apply(self, s, extras, at: Positions):
        """The op on scores ``s`` (``extras`` block-sliced, ``at`` their positions)."""
        return s

    def at_offset(self, d: int, t: int, s: int):
        """The op in a ring step's local positions, its query block (``t`` rows)
        starting ``d`` after its key block (``s`` keys): an op, None (it keeps
        every key there), `EXCLUDED`, or a string saying why no static spec
        states it."""
        return self

    def localized(self, shape4):
        """The op on one shard; ``shape4`` maps an extra's global shape to its
        shard's (batch and heads divided)."""
        return self

    # -- what a ring may skip (`flashpass.ring`) --------------------------------------

    def row_keys(self) -> str:
        """What the op leaves every query row, for a ring that skips the K/V
        blocks its masks exclude (`flashpass.ring.can_skip`): ``"some"`` (a
        key, wherever the row stands), ``"own"`` (its own position and every
        key before it), ``"not own"`` (it may exclude the row's own position),
        ``"own id"`` (the keys whose id is the row's: a key wherever the row's
        own position is kept) or ``"maybe none"`` (a row may keep no key).  A
        weaker answer than the truth only makes the ring skip less."""
        return "some"

    def meets_block(self, r0, r1, c0, c1, extras, kv_len):
        """Whether rows ``[r0, r1]`` may keep some key of ``[c0, c1]`` under the
        op (a traced bool; ``extras`` as the visiting block reads them,
        ``kv_len`` the global key count), or True: it excludes no block."""
        return True

    def empties_a_row(self, extras, kv_len):
        """Whether, at run time, some row keeps no key under the op (a traced
        bool: the original then needs every key's fill), or False: none does."""
        return False

    def key_counts(self, kv_len: int) -> dict[int, int]:
        """The extras holding key counts (kv lengths), which a ring step
        shifts to its K/V block, each with the bound it is clipped to first
        (no count past it compares differently with a key position below
        ``kv_len``)."""
        return {}


class KeepOp(ScoreOp):
    """An op that replaces the scores of the keys it excludes by ``fill``."""

    def keep(self, qi, kj, extras, kv_len=None):
        """The keep-mask at query positions ``qi`` and key positions ``kj``
        (broadcastable to the block); ``kv_len`` bounds key positions."""
        raise NotImplementedError

    def apply(self, s, extras, at: Positions):
        qi, kj = at.grid()
        keep = self.keep(qi, kj, extras, at.kv_len)
        return jnp.where(keep, s, jnp.asarray(self.fill, s.dtype))


class Positional(KeepOp):
    """A mask by position, in one normal form: the keys row ``qi`` keeps are
    the union of `key_ranges`, half-open ``[lo, hi)`` ranges (None: unbounded)
    whose ends never fall as the row grows, whose ``lo`` never jumps past the
    previous row's ``hi``, and that keep a key in every row (as tokamax's
    ``Mask`` states its ``k_start``/``k_end`` per row)."""

    structured = True

    def key_ranges(self, qi):
        """The ``(lo, hi)`` ranges of keys row(s) ``qi`` keep."""
        raise NotImplementedError

    def band(self, qi):
        """The one key range of row ``qi`` that moves with the row (None: the
        op keeps more than one), which sizes a kernel's tiles."""
        ranges = self.key_ranges(qi)
        return ranges[0] if len(ranges) == 1 else None

    def meets_block(self, r0, r1, c0, c1, extras, kv_len):
        return self.meets(r0, r1, c0, c1)

    def keep(self, qi, kj, extras, kv_len=None):
        keep = None
        for lo, hi in self.key_ranges(qi):
            inside = _both(None if lo is None else kj >= lo, None if hi is None else kj < hi)
            inside = kj == kj if inside is None else inside  # (an unbounded range)
            keep = inside if keep is None else keep | inside
        return keep

    def meets(self, r0, r1, c0, c1):
        """Whether rows ``[r0, r1]`` keep some key of ``[c0, c1]`` (numpy or
        traced).  Monotone, gap-free ends: a row meets the tile iff the first
        row's range starts by ``c1`` and the last row's ends after ``c0``."""
        meets = True
        for lo_first, _, _, hi_last in self._ends(r0, r1):
            inside = _both(
                None if lo_first is None else lo_first <= c1,
                None if hi_last is None else hi_last > c0,
            )
            if inside is None:
                return True
            meets = inside if meets is True else meets | inside
        return meets

    def tile_state(self, r0, r1, c0, c1):
        """``(empty, full)`` of tiles with rows ``[r0, r1]`` and keys ``[c0, c1]``
        (broadcast arrays).  Exact for one range; with several, a tile two of
        them cover only together counts as not full."""
        full = False
        for _, lo_last, hi_first, _ in self._ends(r0, r1):
            covers = _both(
                None if lo_last is None else lo_last <= c0,
                None if hi_first is None else hi_first > c1,
            )
            full = full | (True if covers is None else covers)
        meets = self.meets(r0, r1, c0, c1)
        # (`~` of a Python bool is an int: -1 for False.)
        empty = (not meets) if isinstance(meets, bool | np.bool_) else ~meets
        return empty, full

    def _ends(self, r0, r1):
        first, last = self.key_ranges(r0), self.key_ranges(r1)
        return [(a[0], b[0], a[1], b[1]) for a, b in zip(first, last, strict=True)]

    def at_offset(self, d: int, t: int, s: int):
        return f"{type(self).__name__} masks depend on the device's position"


def _both(a, b):
    """``a & b`` where None stands for "always true"."""
    if a is None:
        return b
    return a if b is None else a & b


def with_shape(op, shape4):
    """``op`` with its extra's shape mapped by ``shape4``."""
    return dataclasses.replace(op, shape=shape4(op.shape))


def apply_score_ops(spec, s, extras, q_pos=None, k_pos=None, transposed=False):
    """Apply ``spec.score_ops`` to a score block ``s`` of shape ``[..., t, s]``.

    ``extras`` are the (already block-sliced, broadcastable) bias/mask arrays;
    ``q_pos``/``k_pos`` the absolute query/key positions of the block (default:
    the whole sequence).  Shared by the reference and blockwise kernels so both
    implement the spec identically, and by the engine (which rows keep a key).
    ``transposed``: ``s`` is ``[..., s, t]`` and the positions come as the
    blockwise backward passes them (rows ``-k_pos``, columns ``-q_pos``, see
    `kernels.blockwise.tiles.tile_score_fn`).
    """
    at = Positions(s.shape, q_pos, k_pos, transposed, spec.kv_len)
    for op in spec.score_ops:
        s = op.apply(s, extras, at)
    return s
