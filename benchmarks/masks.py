"""Structured masks on CPU (#18): descriptors vs dense masks vs the original.

Every variant is called under ``jax.jit`` (flashpass variants: the optimized
function, whose call is a ``jit``), compiled once, then timed interleaved
(one call of each variant per round, ``--rounds`` rounds, medians), forward
only.  B=1, H=``--heads``, D=64, float32, S=T=``--seq``.

* ``window``: a causal sliding window of ``--window`` keys, written with iotas
  (the descriptors ``Causal(0)`` + ``Window(W-1, None)``);
  - ``original``: the same code, not optimized;
  - ``dense_mask``: flashpass on the same site with the band passed in as a
    ``[T, S]`` boolean array (a dense ``Mask``; causal skipping still applies);
  - ``additive where`` / ``additive (1 - m)`` / ``additive int min``: the same
    window as a bias added to the scores, ``s + where(keep, 0, FILL)``,
    ``s + (1 - keep.astype(f32)) * FILL`` and ``minimum`` of two int masks
    (read by value into the same descriptors, #28): as fast as ``where``;
* ``sinks``: the window with gpt-oss attention sinks (a per-head logit
  concatenated to the scores, the row max subtracted, the column sliced off;
  the descriptors plus a ``Sink`` op), flashpass against the original;
* ``original's two products only``: the original's ``T x S`` products without
  the mask and softmax, and the bound they set on the window's ratio;
* ``packed``: ``--docs`` documents per row, segment ids compared with ``==``
  and combined with causal (``Segments`` + ``Causal``);
  - ``causal``: flashpass on plain causal attention of the same row;
  - ``dense_mask``: flashpass with the segment mask passed as a ``[T, S]`` array.
* ``padding``: causality and a per-example key (padding) mask from an input,
  ``--pad`` keys padded (#28's Hugging Face form);
  - ``where``: ``where(causal & keys, s, FILL)`` (``Causal`` + a key mask);
  - ``additive, right/left padding``: ``s + where(causal & keys, 0, FILL)``:
    the same descriptors and an ``EmptyRows`` op; right padding leaves no
    row empty (one kernel call after the boolean pass over the keys), left
    padding empties the first ``--pad`` rows (a second kernel call);
  - ``dense bias``: the same bias passed in as a ``[T, S]`` array (what the
    additive form reached the kernel as before ``EmptyRows``).

    python benchmarks/masks.py                # S = 8192, a few minutes on 2 cores
    python benchmarks/masks.py --seq 2048 --rounds 2   # smoke run
    python benchmarks/masks.py --only padding          # the padding group alone
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import flashpass
from flashpass.kernels.blockwise.plan import BAND_TILES, MIN_BAND_BLOCK

FILL = -1e9


def _scores(q, k):
    return jnp.einsum("bhtd,bhsd->bhts", q, k) * (q.shape[-1] ** -0.5)


def _attend(s, v):
    return jnp.einsum("bhts,bhsd->bhtd", jax.nn.softmax(s, axis=-1), v)


def window_fn(width):
    def window(q, k, v):
        t, s_len = q.shape[2], k.shape[2]
        i = lax.broadcasted_iota(jnp.int32, (t, s_len), 0)
        j = lax.broadcasted_iota(jnp.int32, (t, s_len), 1)
        keep = (j <= i) & (i - j < width)
        return _attend(jnp.where(keep, _scores(q, k), FILL), v)

    return window


def window_additive_fn(width, spelling):
    """The causal window as an additive bias, in one library spelling."""

    def window_additive(q, k, v):
        t, s_len = q.shape[2], k.shape[2]
        i = lax.broadcasted_iota(jnp.int32, (t, s_len), 0)
        j = lax.broadcasted_iota(jnp.int32, (t, s_len), 1)
        if spelling == "where":
            bias = jnp.where((j <= i) & (i - j < width), 0.0, FILL)
        elif spelling == "one_minus":
            bias = (1.0 - ((j <= i) & (i - j < width)).astype(jnp.float32)) * FILL
        else:  # int minimum
            m = jnp.minimum((j <= i).astype(jnp.int32), (i - j < width).astype(jnp.int32))
            bias = (1 - m) * FILL
        return _attend(_scores(q, k) + bias, v)

    return window_additive


ADDITIVE = {"additive where": "where", "additive (1 - m)": "one_minus", "additive int min": "min"}


def window_sinks_fn(width):
    def window_sinks(q, k, v, sinks):
        t, s_len = q.shape[2], k.shape[2]
        i = lax.broadcasted_iota(jnp.int32, (t, s_len), 0)
        j = lax.broadcasted_iota(jnp.int32, (t, s_len), 1)
        s = jnp.where((j <= i) & (i - j < width), _scores(q, k), FILL)
        col = jnp.broadcast_to(sinks.reshape(1, -1, 1, 1), (*s.shape[:-1], 1))
        c = jnp.concatenate([s, col], axis=-1)
        c = c - lax.stop_gradient(c.max(-1, keepdims=True))
        p = jax.nn.softmax(c, axis=-1)[..., :-1]
        return jnp.einsum("bhts,bhsd->bhtd", p, v)

    return window_sinks


def causal_and_mask(q, k, v, mask):
    t, s_len = q.shape[2], k.shape[2]
    i = lax.broadcasted_iota(jnp.int32, (t, s_len), 0)
    j = lax.broadcasted_iota(jnp.int32, (t, s_len), 1)
    return _attend(jnp.where((j <= i) & mask, _scores(q, k), FILL), v)


def causal(q, k, v):
    t, s_len = q.shape[2], k.shape[2]
    i = lax.broadcasted_iota(jnp.int32, (t, s_len), 0)
    j = lax.broadcasted_iota(jnp.int32, (t, s_len), 1)
    return _attend(jnp.where(j <= i, _scores(q, k), FILL), v)


def packed(q, k, v, ids):
    t, s_len = q.shape[2], k.shape[2]
    i = lax.broadcasted_iota(jnp.int32, (t, s_len), 0)
    j = lax.broadcasted_iota(jnp.int32, (t, s_len), 1)
    same = ids[:, None, :, None] == ids[:, None, None, :]
    return _attend(jnp.where(same & (j <= i), _scores(q, k), FILL), v)


def causal_keys_where(q, k, v, keys):
    t, s_len = q.shape[2], k.shape[2]
    i = lax.broadcasted_iota(jnp.int32, (t, s_len), 0)
    j = lax.broadcasted_iota(jnp.int32, (t, s_len), 1)
    keep = (j <= i) & keys[:, None, None, :]
    return _attend(jnp.where(keep, _scores(q, k), FILL), v)


def causal_keys_additive(q, k, v, keys):
    t, s_len = q.shape[2], k.shape[2]
    i = lax.broadcasted_iota(jnp.int32, (t, s_len), 0)
    j = lax.broadcasted_iota(jnp.int32, (t, s_len), 1)
    keep = (j <= i) & keys[:, None, None, :]
    return _attend(_scores(q, k) + jnp.where(keep, 0.0, FILL), v)


def dense_bias(q, k, v, bias):
    return _attend(_scores(q, k) + bias, v)


def padding(q, k, v, pad: int, rounds: int) -> None:
    """The padding group (see the module docstring): prints times and ratios."""
    n = q.shape[2]
    right = np.ones((1, n), bool)
    right[:, n - pad :] = False
    left = right[:, ::-1].copy()
    right, left = jnp.asarray(right), jnp.asarray(left)
    bias = jnp.where(np.tril(np.ones((n, n), bool)) & left[:, None, None, :], 0.0, FILL)
    where_opt = flashpass.optimize(causal_keys_where)
    additive_opt = flashpass.optimize(causal_keys_additive)
    print(additive_opt.explain(q, k, v, left))
    variants = {
        "padding: where (descriptors)": (where_opt, (q, k, v, right)),
        "padding: additive, right padding": (additive_opt, (q, k, v, right)),
        "padding: additive, left padding": (additive_opt, (q, k, v, left)),
        "padding: dense bias": (flashpass.optimize(dense_bias), (q, k, v, bias)),
    }
    result = interleaved(variants, rounds)
    for name, seconds in result.items():
        print(f"{name:40s} {seconds * 1e3:10.1f} ms")
    w = result["padding: where (descriptors)"]
    for name in list(result)[1:]:
        print(f"{name + ' / where':48s} = {result[name] / w:.2f}x")


def products(q, k, v):
    """The original's two ``T x S`` products alone (no mask, no softmax): what
    its time is made of on CPU, and what bounds any kernel's ratio against it."""
    return jnp.einsum("bhts,bhsd->bhtd", _scores(q, k), v)


def band_keys(window: int) -> int:
    """Keys per query row the blockwise kernel's tiles cover under a causal
    window (default band tiles, `plan.default_blocks`), for tile-aligned rows."""
    tile = max(1 << ((window // BAND_TILES).bit_length() - 1), MIN_BAND_BLOCK)
    return (-(-(window - 1) // tile) + 1) * tile


def interleaved(variants: dict, rounds: int) -> dict:
    """Median seconds per call of each variant, timed round-robin."""
    for fn, args in variants.values():
        jax.block_until_ready(fn(*args))  # compile
    times = {name: [] for name in variants}
    for _ in range(rounds):
        for name, (fn, args) in variants.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--docs", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pad", type=int, default=512)
    parser.add_argument("--skip-original", action="store_true")
    parser.add_argument("--only", choices=["padding"], help="run one group alone")
    args = parser.parse_args()
    n, h = args.seq, args.heads
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((1, h, n, 64)), jnp.float32) for _ in range(3))
    if args.only == "padding":
        print(f"JAX {jax.__version__} on {jax.default_backend()}; B=1 H={h} D=64 S=T={n} f32")
        padding(q, k, v, args.pad, args.rounds)
        return
    pos = np.arange(n)
    band = jnp.asarray(pos[:, None] - pos[None, :] < args.window)
    ids = jnp.asarray((pos * args.docs // n)[None].astype(np.int32))
    same = jnp.asarray(np.asarray(ids)[0][:, None] == np.asarray(ids)[0][None, :])

    print(f"JAX {jax.__version__} on {jax.default_backend()}; B=1 H={h} D=64 S=T={n} f32")
    win = window_fn(args.window)
    opt_win = flashpass.optimize(win)
    print(opt_win.explain(q, k, v))
    variants = {"window: flashpass (descriptors)": (opt_win, (q, k, v))}
    want = opt_win.explain(q, k, v).rewrites[0].spec["score_ops"]
    for name, spelling in ADDITIVE.items():  # (before the dense mask, which thrashes caches)
        opt = flashpass.optimize(window_additive_fn(args.window, spelling))
        assert opt.explain(q, k, v).rewrites[0].spec["score_ops"] == want, name
        variants[f"window: flashpass ({name})"] = (opt, (q, k, v))
    variants["window: flashpass (dense mask)"] = (
        flashpass.optimize(causal_and_mask),
        (q, k, v, band),
    )
    sinks = jnp.asarray(rng.standard_normal(h), jnp.float32)
    win_sinks = window_sinks_fn(args.window)
    opt_sinks = flashpass.optimize(win_sinks)
    print(opt_sinks.explain(q, k, v, sinks))
    variants["sinks: flashpass (descriptors + Sink)"] = (opt_sinks, (q, k, v, sinks))
    if not args.skip_original:
        variants["window: original"] = (jax.jit(win), (q, k, v))
        variants["sinks: original"] = (jax.jit(win_sinks), (q, k, v, sinks))
        variants["window: original's two products only"] = (jax.jit(products), (q, k, v))
    result = interleaved(variants, args.rounds)
    opt_packed = flashpass.optimize(packed)
    print(opt_packed.explain(q, k, v, ids))
    docs = {
        "packed: flashpass (segment ids)": (opt_packed, (q, k, v, ids)),
        "packed: flashpass (dense mask)": (flashpass.optimize(causal_and_mask), (q, k, v, same)),
        "packed: flashpass (plain causal)": (flashpass.optimize(causal), (q, k, v)),
    }
    result.update(interleaved(docs, args.rounds))
    for name, seconds in result.items():
        print(f"{name:40s} {seconds * 1e3:10.1f} ms")
    w = result["window: flashpass (descriptors)"]
    print(f"window: dense mask / descriptors = {result['window: flashpass (dense mask)'] / w:.1f}x")
    for name in ADDITIVE:
        ratio = result[f"window: flashpass ({name})"] / w
        print(f"window: {name + ' / where':32s} = {ratio:.2f}x")
    ws = result["sinks: flashpass (descriptors + Sink)"]
    print(f"sinks: flashpass / window flashpass = {ws / w:.2f}x")
    if not args.skip_original:
        print(f"window: original / descriptors   = {result['window: original'] / w:.1f}x")
        print(f"sinks: original / flashpass      = {result['sinks: original'] / ws:.1f}x")
        original, prods = result["window: original"], result["window: original's two products only"]
        share = n / band_keys(args.window)
        print(
            f"window: the original's products are {prods / original:.0%} of its time; the "
            f"kernel's tiles cover {band_keys(args.window)} of {n} keys per row (1/{share:.1f}), "
            f"so at the same product rate the ratio is at most {original / (prods / share):.1f}x"
        )
    p = result["packed: flashpass (segment ids)"]
    plain = result["packed: flashpass (plain causal)"]
    print(f"packed: plain causal / segments  = {plain / p:.1f}x")
    print(f"packed: dense mask / segments    = {result['packed: flashpass (dense mask)'] / p:.1f}x")
    padding(q, k, v, args.pad, args.rounds)


if __name__ == "__main__":
    main()
