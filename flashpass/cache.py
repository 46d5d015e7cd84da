"""The side table of an optimized function: one entry per input signature.

Each entry holds what the pass made of one signature (the program as traced,
as rewritten, and its report).  The table is a bounded LRU (``cache_size``);
`flashpass.api.Optimized` clears its ``jit``'s compiled programs when the
table evicts (``jit`` keeps one per signature and cannot drop a single one),
and `release_freed_memory` gives the freed heap back to the system.
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import sys
from typing import Any

from .report import Report


@dataclasses.dataclass
class Entry:
    """Everything the side table keeps for one input signature."""

    original: Any  # ClosedJaxpr as traced
    rewritten: Any  # ClosedJaxpr after the pass
    out_tree: Any
    report: Report
    logged: bool = False  # whether the report was logged (when the program is staged)


class SignatureTable:
    """At most ``size`` entries, least recently used first (not thread-safe:
    the caller holds its lock)."""

    def __init__(self, size: int):
        self.size = size
        self._entries: collections.OrderedDict = collections.OrderedDict()

    def get(self, key) -> Entry | None:
        """The entry of ``key`` (now the most recently used), or None."""
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def put(self, key, entry: Entry) -> bool:
        """Keep ``entry``; True when older entries were evicted for it."""
        self._entries[key] = entry
        if len(self._entries) <= self.size:
            return False
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)
        return True

    def values(self):
        return self._entries.values()

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


def _malloc_trim():
    """glibc's ``malloc_trim`` (None elsewhere: macOS, Windows, musl)."""
    try:
        return ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):
        return None


_MALLOC_TRIM = _malloc_trim() if sys.platform.startswith("linux") else None


def release_freed_memory() -> None:
    """Return the heap that freed programs leave behind to the operating system.

    A compiled program is allocated by XLA's compile threads; when it is freed
    (an eviction clears ``jit``'s programs) glibc keeps the pages in those
    threads' arenas, so the process's resident memory would stay as high as if
    the programs were alive.  ``malloc_trim(0)`` gives free pages back (a few
    milliseconds, next to the compilation that caused the eviction); elsewhere
    this does nothing.
    """
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)
