"""Bounded resources: the per-function cache, what it retains, and memory.

An optimized function is called (``explain`` traces, matches and rewrites
without compiling, which is what fills the cache) with 1,000 distinct input
signatures.  Checked:

* the cache never holds more than ``cache_size`` entries (for several sizes);
* every evicted entry — its jaxprs and report — and every
  input array is freed, by reference counting alone (no reference cycles);
* Python memory (tracemalloc, 500 signatures) grows no faster than JAX's own
  tracing caches grow: ``jax.make_jaxpr`` of a fresh function retains ~2 KB
  per call in JAX's internal LRU caches until they fill, flashpass traces
  twice per signature, and a leaked cache entry would add ~15 KB per
  signature on top (process RSS is bounded loosely too);
* compiled calls release their executables' wrappers when evicted;
* flashpass's module-level caches (kernel probes, kernel calls) stay bounded.

Inputs are NumPy arrays (a new ``jnp`` array shape would cost an XLA
compilation each) and the signature varies in an argument the attention does
not read, so JAX's per-shape caches stay warm: the test measures flashpass.
"""

import gc
import os
import subprocess
import sys
import tracemalloc
import weakref

import jax
import numpy as np
import pytest
from jax import lax

import flashpass
from flashpass import calls, select

N_SIGNATURES = 1000


def attention(q, k, v, extra):
    """One site (lax spellings: jnp.einsum creates a fresh jit per call)."""
    s = lax.dot_general(q, k, (((3,), (3,)), ((0, 1), (0, 1)))) * 0.5
    return lax.dot_general(jax.nn.softmax(s, -1), v, (((3,), (2,)), ((0, 1), (0, 1))))


QKV = tuple(np.full((1, 2, 4, 4), 0.1 * i, np.float32) for i in (1, 2, 3))


def _signature(n: int):
    """Distinct input signature ``n``: the unread argument has length n."""
    return np.zeros((n,), np.float32)


def _entry_refs(opt) -> list:
    refs = []
    for entry in opt._cache.values():
        for obj in (entry, entry.original, entry.rewritten, entry.report):
            refs.append(weakref.ref(obj))
    return refs


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _jax_make_jaxpr_growth(calls: int) -> float:
    """Bytes JAX itself retains per ``make_jaxpr`` of a fresh function (baseline)."""

    def fresh():
        return lambda x, extra: lax.exp(x) * 2.0

    x = np.ones((4,), np.float32)
    for n in range(50):
        jax.make_jaxpr(fresh())(x, _signature(10_000 + n))
    gc.collect()
    before = tracemalloc.get_traced_memory()[0]
    for n in range(calls):
        jax.make_jaxpr(fresh())(x, _signature(20_000 + n))
    gc.collect()
    return (tracemalloc.get_traced_memory()[0] - before) / calls


@pytest.mark.parametrize("cache_size", [1, 8])
def test_cache_stays_bounded_and_releases_evicted_entries(cache_size):
    opt = flashpass.optimize(attention, kernel="reference", cache_size=cache_size)
    assert opt.cache_info()["max_size"] == cache_size
    dead_after_eviction = []
    arrays = []
    gc.disable()  # evicted entries must die by reference counting: no cycles
    try:
        for n in range(1, N_SIGNATURES + 1):
            extra = _signature(n)
            arrays.append(weakref.ref(extra))
            before = _entry_refs(opt)
            report = opt.explain(*QKV, extra)
            del extra
            assert len(report.rewrites) == 1
            assert opt.cache_info()["size"] == min(n, cache_size)
            if n > cache_size and n % 97 == 0:
                # the entry evicted by this call is gone already, without gc
                dead_after_eviction.append(before[0]() is None)
    finally:
        gc.enable()
    assert opt.cache_info()["traces"] == N_SIGNATURES
    assert all(dead_after_eviction), dead_after_eviction
    gc.collect()
    assert sum(r() is not None for r in arrays) == 0, "input arrays are retained"
    alive = _entry_refs(opt)
    assert len(alive) == 4 * cache_size
    # the most recent signatures are cached (LRU), an evicted one is traced again
    opt.explain(*QKV, _signature(N_SIGNATURES))
    assert opt.cache_info()["traces"] == N_SIGNATURES
    opt.explain(*QKV, _signature(1))
    assert opt.cache_info()["traces"] == N_SIGNATURES + 1


def test_memory_grows_no_faster_than_jax_tracing():
    opt = flashpass.optimize(attention, kernel="reference", cache_size=8)
    for n in range(1, 101):  # warm every cache flashpass and JAX fill once
        opt.explain(*QKV, _signature(n))
    gc.collect()
    rss_before = _rss_mib()
    tracemalloc.start()
    try:
        baseline = _jax_make_jaxpr_growth(200)
        before = tracemalloc.get_traced_memory()[0]
        n_measured = 500
        for n in range(101, 101 + n_measured):
            opt.explain(*QKV, _signature(n))
        gc.collect()
        per_signature = (tracemalloc.get_traced_memory()[0] - before) / n_measured
    finally:
        tracemalloc.stop()
    # flashpass traces twice per signature (the function, then the rewrite)
    allowed = 2 * baseline + 2048
    assert per_signature <= allowed, (
        f"{per_signature:.0f} B retained per signature; JAX's own make_jaxpr retains "
        f"{baseline:.0f} B per call, so at most {allowed:.0f} B were expected"
    )
    assert _rss_mib() - rss_before < 64


def test_compiled_calls_release_evicted_executables():
    """Calls go through one ``jax.jit``; an eviction clears its compiled
    programs (jit cannot drop a single signature), so at most ``cache_size``
    executables are ever held."""
    opt = flashpass.optimize(attention, kernel="reference", cache_size=2)
    outputs = []
    for n in range(1, 13):
        out = opt(*QKV, _signature(n))
        outputs.append(weakref.ref(out))
        del out
        assert opt._jitted._cache_size() <= 2
        assert opt.cache_info()["size"] == min(n, 2)
    gc.collect()
    assert sum(r() is not None for r in outputs) == 0
    opt.clear_cache()
    assert opt._jitted._cache_size() == 0 and opt.cache_info()["size"] == 0


def test_module_level_caches_are_bounded(monkeypatch):
    """Kernel probes and kernel calls are cached per spec across all functions;
    both caches are LRU-bounded (checked here with a small probe limit)."""
    monkeypatch.setattr(select, "_PROBE_LIMIT", 8)
    select.clear_probe_cache()
    opt = flashpass.optimize(attention, kernel="reference", cache_size=4)
    for t in range(1, 25):  # 24 distinct specs (query lengths)
        q = np.zeros((1, 2, t, 4), np.float32)
        assert len(opt.explain(q, *QKV[1:], _signature(1)).rewrites) == 1
        assert len(select._PROBES) <= 8
    info = calls.kernel_call.cache_info()
    assert info.maxsize is not None and info.currsize <= info.maxsize


def test_dropping_the_optimized_function_frees_everything():
    opt = flashpass.optimize(attention, kernel="reference")
    opt(*QKV, _signature(3))
    refs = [weakref.ref(opt), *_entry_refs(opt)]
    gc.disable()
    try:
        del opt
        assert all(r() is None for r in refs), "an optimized function is in a reference cycle"
    finally:
        gc.enable()


class _Layer:
    """A module-style object whose method is optimized (per-instance caches)."""

    def __init__(self, scale):
        self.scale = scale
        self.weights = np.ones((256, 256), np.float32)  # 256 KiB a layer

    @flashpass.optimize(kernel="reference")
    def __call__(self, q, k, v):
        s = lax.dot_general(q, k, (((3,), (3,)), ((0, 1), (0, 1)))) * self.scale
        return lax.dot_general(jax.nn.softmax(s, -1), v, (((3,), (2,)), ((0, 1), (0, 1))))


class _UnhashableLayer(_Layer):
    __hash__ = None  # e.g. an Equinox/dataclass module holding arrays

    def __eq__(self, other):
        return self is other


class _ValueEqualLayer(_Layer):
    """Equal by value (a frozen-dataclass module): instances must still not share."""

    def __eq__(self, other):
        return type(other) is type(self) and other.scale == self.scale

    def __hash__(self):
        return hash(self.scale)


class _SlottedLayer:
    """No ``__weakref__``: cannot be held weakly."""

    __slots__ = ("scale",)

    def __init__(self, scale):
        self.scale = scale

    __call__ = _Layer.__call__


@pytest.mark.parametrize("cls", [_Layer, _UnhashableLayer, _ValueEqualLayer])
def test_decorated_methods_do_not_retain_instances(cls):
    """The per-instance cache must not hold its instance (and the instance's
    arrays) forever: it holds it weakly and is dropped with it."""
    refs = []
    for i in range(5):
        layer = cls(0.1 * (i + 1))
        layer(*QKV[:3])
        refs.append(weakref.ref(layer))
        del layer
    gc.collect()
    assert sum(r() is not None for r in refs) == 0, "instances are retained"
    assert not cls.__call__._instances, "per-instance caches are not pruned"


@pytest.mark.parametrize("cls", [_Layer, _UnhashableLayer, _ValueEqualLayer])
def test_decorated_methods_cache_per_instance(cls):
    a, b = cls(0.5), cls(0.5)  # equal by value for _ValueEqualLayer
    a(*QKV[:3])
    a(*QKV[:3])
    a.__call__.explain(*QKV[:3])
    assert a.__call__.traces == 1, "a second call on the same instance must not trace again"
    assert b.__call__.traces == 0, "each instance has its own cache"
    other = cls(2.0)
    np.testing.assert_allclose(other(*QKV[:3]), _Layer.__call__._fn(other, *QKV[:3]), rtol=1e-6)


def test_a_bound_method_keeps_its_instance_alive():
    """``obj.method`` holds ``obj`` as a Python bound method does."""
    method = _Layer(0.5).__call__  # the only reference to the instance
    gc.collect()
    expected = _Layer.__call__._fn(method.__self__, *QKV[:3])
    np.testing.assert_allclose(method(*QKV[:3]), expected, rtol=1e-6)
    np.testing.assert_allclose(method(*QKV[:3]), expected, rtol=1e-6)
    assert method.traces == 1
    instance = weakref.ref(method.__self__)
    del method
    gc.collect()
    assert instance() is None


def test_instances_without_weak_references():
    """Cannot be cached weakly: a fresh cache per attribute access, nothing retained."""
    layer = _SlottedLayer(0.5)
    expected = _Layer.__call__._fn(layer, *QKV[:3])
    np.testing.assert_allclose(layer(*QKV[:3]), expected, rtol=1e-6)
    method = layer.__call__
    method(*QKV[:3])
    method(*QKV[:3])
    assert method.traces == 1
    assert not _SlottedLayer.__call__._instances


# --------------------------------------------------------------------------- resident memory

_DECODE_CHILD = r"""
import ctypes, gc, sys
import jax, jax.numpy as jnp, numpy as np
import flashpass

def rss_mib():
    # Free heap returned first (glibc): a compilation's temporaries would
    # otherwise count, in whichever thread arena they were freed.
    ctypes.CDLL(None).malloc_trim(0)
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024

def step(q, k, v, lengths):
    s = jnp.einsum("bhtd,bhsd->bhts", q, k) * 0.25
    keep = jnp.arange(k.shape[2])[None, :] < lengths[:, None]
    s = jnp.where(keep[:, None, None, :], s, -1e9)
    return jnp.einsum("bhts,bhsd->bhtd", jax.nn.softmax(s, axis=-1), v)

mode, warm, shapes, cache_size, b, h, d, s0, ds = sys.argv[1:]
warm, shapes, cache_size, b, h, d, s0, ds = map(int, (warm, shapes, cache_size, b, h, d, s0, ds))
if mode == "jit":
    call = jax.jit(step)
else:  # forced: on CPU the cost model keeps short caches as written
    call = flashpass.optimize(step, kernel="blockwise", cache_size=cache_size)

def run(i):
    s = s0 + ds * i
    kv = np.ones((b, h, s, d), np.float32)
    lengths = np.linspace(s // 3, s, b).astype(np.int32)
    jax.block_until_ready(call(np.ones((b, h, 1, d), np.float32), kv, kv, lengths))

for i in range(warm):
    run(i)
if mode == "opt":
    kv = np.ones((b, h, s0, d), np.float32)
    q, n = np.ones((b, h, 1, d), np.float32), np.ones((b,), np.int32)
    assert call.explain(q, kv, kv, n).rewrites[0].mask == "kv_lengths"
gc.collect()
before = rss_mib()
for i in range(warm, warm + shapes):
    run(i)
gc.collect()
print(rss_mib() - before)
"""


def _decode_rss_growth(mode, warm, shapes, cache_size, b, h, d, s0, ds) -> float:
    """VmRSS growth (MiB) of a fresh process calling a decode step on
    ``shapes`` new cache lengths after ``warm`` of them: current resident
    memory (``ru_maxrss`` would be the peak, and survives ``exec``), read
    after ``malloc_trim`` so that it counts what is held, not the allocator's
    free pages (a compilation leaves tens of MB of them in its thread's arena)."""
    argv = [mode, warm, shapes, cache_size, b, h, d, s0, ds]
    out = subprocess.run(
        [sys.executable, "-c", _DECODE_CHILD, *map(str, argv)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return float(out.stdout.split()[-1])


def _check_decode_memory(shapes, cache_size, b, h, d, s0, ds, limit_mib):
    args = (6, shapes, cache_size, b, h, d, s0, ds)
    baseline = _decode_rss_growth("jit", *args)
    if baseline < 1.0 * shapes:  # no per-shape growth to compare with: inconclusive
        pytest.skip(f"plain jax.jit grew only {baseline:.0f} MiB over {shapes} shapes here")
    grown = _decode_rss_growth("opt", *args)
    # jit keeps every shape's program; the optimized function at most
    # cache_size of them, and returns the freed heap (cache.release_freed_memory).
    assert grown <= min(0.6 * baseline, limit_mib), (
        f"optimized decode step grew {grown:.0f} MiB over {shapes} new shapes "
        f"(cache_size={cache_size}); plain jax.jit grew {baseline:.0f} MiB"
    )


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc, /proc/self/status")
def test_decode_step_memory_is_bounded_across_shapes():
    """A served decode step called on new shapes, in a subprocess, with a
    small cache: resident memory grows well below plain ``jax.jit``'s."""
    _check_decode_memory(12, 2, b=2, h=2, d=16, s0=64, ds=8, limit_mib=64)


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc, /proc/self/status")
def test_decode_step_memory_over_96_shapes():
    """96 new cache lengths (B=4, H=8, D=64, from 2048 on, the decode path),
    ``cache_size=12``: at most 150 MB.  (The goal of 250 shapes at
    ``cache_size=32``, about 500 compiles and 15 minutes here, is measured by
    `python benchmarks/decode.py --memory 250`, which prints both growths.)"""
    _check_decode_memory(96, 12, b=4, h=8, d=64, s0=2048, ds=16, limit_mib=150)


def test_folding_masks_in_numpy_is_exact():
    """Constant folding evaluates a mask's index equations in NumPy
    (`compat._host`), exactly as XLA does, and compiles no program per shape
    (JAX would keep each one in a process-wide cache)."""
    from flashpass import compat

    def mask(n):
        i = lax.broadcasted_iota(np.int32, (n, n), 0)
        j = lax.broadcasted_iota(np.int32, (n, n), 1) + 1
        keep = (~(i >= j) & (j - i < 5)) | (i * 3 == j)
        fill = lax.broadcast_in_dim(np.float32(-1e9), (n, n), ())
        return lax.select(keep.reshape(1, n, n).squeeze(0).T, i.astype(np.float32), fill)

    closed = jax.make_jaxpr(lambda: mask(37))()
    env = {}
    for eqn in closed.jaxpr.eqns:
        args = [v.val if hasattr(v, "val") else env[v] for v in eqn.invars]
        (host,) = compat._host.evaluate(eqn, args) or [None]
        assert host is not None, eqn.primitive
        with compat.compile_time_eval():
            (bound,) = compat.bind_equation(eqn, args)
        np.testing.assert_array_equal(host, np.asarray(bound))
        env[eqn.outvars[0]] = host
