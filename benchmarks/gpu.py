"""GPU verification: correctness of each GPU kernel, then a timing table.

1. Correctness: every GPU kernel adapter (``cudnn``, ``pallas_gpu``, and
   ``tokamax`` when installed) against `reference_attention` in float64, forward
   and gradients, on small shapes covering causal, key padding, GQA, odd
   lengths and cross-attention; then a model end to end: the naive attention
   below, rewritten by ``flashpass.optimize``, against itself unrewritten.
2. Timing (GPU only): naive XLA attention vs the same function rewritten by
   flashpass (default GPU order: cuDNN first) vs a hand-written
   ``jax.nn.dot_product_attention(implementation="cudnn")``; bfloat16,
   B=4, H=16, D=128, S = 1k..16k, causal and not, forward and forward+backward;
   median milliseconds and achieved TFLOP/s (forward ``4*B*H*T*S*D`` flops,
   halved when causal; forward+backward 3.5x that, FlashAttention's
   accounting), as a Markdown table for docs/benchmarks.md.

    python benchmarks/gpu.py                   # on a GPU: both parts
    python benchmarks/gpu.py --sizes 1024 8192 # fewer sizes
    python benchmarks/gpu.py --cpu-check       # anywhere: correctness only, small
                                               # shapes, Pallas in interpret mode,
                                               # cuDNN's transforms on XLA

Exit status 1 if any correctness check fails.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import flashpass
from flashpass import compat
from flashpass.kernels import AttentionSpec, Causal, CheckContext, ExtraSpec, Mask, Scale
from flashpass.kernels.cudnn import CudnnKernel
from flashpass.kernels.pallas_gpu import PallasGpuKernel
from flashpass.kernels.reference import reference_attention
from flashpass.kernels.tokamax import TokamaxKernel

BF16 = np.dtype(jnp.bfloat16)
F32 = np.dtype(np.float32)
TOL = {F32: 2e-5, BF16: 3e-2}


# --------------------------------------------------------------------------- models


def naive_attention(q, k, v, causal: bool):
    """Attention as a model writes it: ``[B, T, H, D]``, f32 softmax, bf16 matmuls."""
    d = q.shape[-1]
    s = jnp.einsum("bthd,bshd->bhts", q, k, preferred_element_type=jnp.float32) / np.sqrt(d)
    if causal:
        t, n = s.shape[-2:]
        s = jnp.where(jnp.arange(n)[None, :] <= jnp.arange(t)[:, None], s, -1e9)
    p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
    return jnp.einsum("bhts,bshd->bthd", p, v)


def cudnn_attention(q, k, v, causal: bool):
    """The hand-written cuDNN call the rewritten model should match."""
    return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")


# --------------------------------------------------------------------------- correctness


def _spec(b, h, hkv, t, s, d, dtype, ops=(), extras=()):
    return AttentionSpec(
        b, h, hkv, t, s, d, d, dtype, dtype, dtype, dtype, F32, dtype, tuple(ops), tuple(extras)
    )


def correctness_cases(dtype):
    """name -> (spec, extras): small shapes that exercise every transform."""
    rng = np.random.default_rng(0)
    keep = rng.random((2, 1, 1, 40)) < 0.8
    keep[..., 0] = True
    keep[1] = False  # a fully padded example
    mask_spec = ExtraSpec((2, 1, 1, 40), np.dtype(bool))
    return {
        "causal": (_spec(2, 2, 2, 32, 32, 64, dtype, [Scale(0.125), Causal(0, -1e9)]), []),
        "gqa_key_padding": (
            _spec(
                2, 4, 2, 24, 40, 32, dtype, [Scale(0.2), Mask(0, (2, 1, 1, 40), -1e9)], [mask_spec]
            ),
            [jnp.asarray(keep)],
        ),
        "odd_bottom_right_causal": (
            _spec(1, 2, 1, 19, 37, 40, dtype, [Scale(0.15), Causal(18, -1e9)]),
            [],
        ),
        "cross": (_spec(2, 2, 2, 12, 48, 16, dtype, [Scale(0.25)]), []),
    }


def _value_and_grads(fn, arrays, cotangent):
    diff = [i for i, a in enumerate(arrays) if a.dtype != jnp.bool_]

    def f(*d):
        full = list(arrays)
        for i, a in zip(diff, d, strict=True):
            full[i] = a
        return fn(*full)

    out, vjp = jax.vjp(f, *[arrays[i] for i in diff])
    return out, vjp(cotangent.astype(out.dtype))


def _rel_err(actual, expected) -> float:
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    if not np.all(np.isfinite(actual)):
        return float("inf")
    return float(np.max(np.abs(actual - expected)) / max(np.max(np.abs(expected)), 1e-30))


#: ``jax.jit`` for the correctness part; --cpu-check compiles at -O0 (interpret
#: mode's cost is XLA:CPU compile time; the level does not change float semantics).
_jit = jax.jit


def check_kernel(kernel, spec, extras, *, interpret: bool) -> float:
    """Largest relative error of the output and gradients vs the float64 reference."""
    rng = np.random.default_rng(1)
    q, k, v = (
        jnp.asarray(rng.standard_normal(shape), F32).astype(spec.q_dtype)
        for shape in (spec.q_shape, spec.k_shape, spec.v_shape)
    )
    arrays = (q, k, v, *extras)
    cotangent = jnp.asarray(rng.standard_normal(spec.out_shape), F32)

    def run(q, k, v, *ex):
        return kernel.apply(spec, q, k, v, ex, interpret=interpret)

    out, grads = _jit(lambda *a: _value_and_grads(run, a, cotangent))(*arrays)
    with jax.enable_x64(True):
        wide = [a if a.dtype == jnp.bool_ else jnp.asarray(a, jnp.float64) for a in arrays]

        def oracle(q, k, v, *ex):
            return reference_attention(spec, q, k, v, ex, dtype=jnp.float64)

        ref, ref_grads = _jit(lambda *a: _value_and_grads(oracle, a, cotangent))(*wide)
    return max(_rel_err(a, b) for a, b in zip((out, *grads), (ref, *ref_grads), strict=True))


def correctness(cpu_check: bool) -> bool:
    on_gpu = compat.gpu_compute_capability() is not None
    kernels = []
    if on_gpu:
        kernels.append(("cudnn", CudnnKernel(), False))
        kernels.append(("pallas_gpu", PallasGpuKernel(), False))
        if compat.tokamax_module() is not None:
            kernels.append(("tokamax", TokamaxKernel(), False))
    if cpu_check or not on_gpu:
        kernels.append(("pallas_gpu (interpret)", PallasGpuKernel(), True))
        kernels.append(("cudnn adapter on XLA", CudnnKernel(implementation="xla"), False))
    ok = True
    print("correctness vs float64 reference (max relative error of output and gradients)")
    gpu = CheckContext(platform="gpu", explicit=True)
    small = cpu_check or not on_gpu
    for label, kernel, interpret in kernels:
        for dtype in (BF16, F32):
            for name, (spec, extras) in correctness_cases(dtype).items():
                if small and (name == "cross" or (dtype == F32 and name != "gqa_key_padding")):
                    continue  # interpret mode is slow: fewer cases, float32 once
                with compat.assume_cudnn() if not on_gpu else contextlib.nullcontext():
                    reasons = kernel.check(spec, gpu)
                if reasons:
                    print(f"  {label:<24} {name:<24} {dtype.name:<8} skipped: {reasons[0][:60]}")
                    continue
                err = check_kernel(kernel, spec, extras, interpret=interpret)
                good = err < TOL[dtype]
                ok &= good
                status = "ok" if good else "FAIL"
                print(f"  {label:<24} {name:<24} {dtype.name:<8} {err:9.2e}  {status}")

    # End to end: the model rewritten by flashpass against itself unrewritten.
    shape = (2, 64, 4, 32) if (cpu_check or not on_gpu) else (2, 512, 8, 128)
    rng = np.random.default_rng(2)
    q, k, v = (jnp.asarray(rng.standard_normal(shape), BF16) for _ in range(3))
    for causal in (True,) if small else (False, True):

        def model(q, k, v, causal=causal):
            return naive_attention(q, k, v, causal)

        opt = flashpass.optimize(model, platform="gpu", interpret=not on_gpu)
        report = opt.explain(q, k, v)
        chosen = ",".join(report.kernels) or "none"

        def loss(f):
            return lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32) ** 2)

        value, grads = _jit(jax.value_and_grad(loss(opt), argnums=(0, 1, 2)))(q, k, v)
        want, want_grads = _jit(jax.value_and_grad(loss(model), argnums=(0, 1, 2)))(q, k, v)
        err = max(_rel_err(a, b) for a, b in zip((value, *grads), (want, *want_grads), strict=True))
        # Two bfloat16 computations (rewritten and not) differ by roundings of both.
        good = bool(report.kernels) and err < 2 * TOL[BF16]
        ok &= good
        label = f"model, {'causal' if causal else 'full'}"
        print(
            f"  {'flashpass.optimize':<24} {label:<24} kernel={chosen:<12} {err:9.2e}  "
            f"{'ok' if good else 'FAIL'}"
        )
    return ok


# --------------------------------------------------------------------------- timing


def _median_ms(fn, args, reps: int) -> float:
    jax.block_until_ready(fn(*args))  # compile + warm up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def _fwd_bwd(f):
    def loss(q, k, v):
        return jnp.sum(f(q, k, v).astype(jnp.float32))

    return jax.grad(loss, argnums=(0, 1, 2))


def timing(sizes, batch: int, heads: int, dim: int, reps: int) -> None:
    device = jax.devices()[0]
    print()
    print(f"## flashpass on {device.device_kind}")
    print()
    print(
        f"{datetime.date.today().isoformat()}, JAX {jax.__version__}, "
        f"bfloat16, B={batch}, H={heads}, D={dim}, median of {reps} runs"
    )
    print()
    print(
        "| S | causal | pass | naive XLA ms (TFLOP/s) | flashpass ms (TFLOP/s) [kernel] "
        "| cuDNN by hand ms (TFLOP/s) | flashpass vs cuDNN | flashpass vs naive |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for n in sizes:
        rng = np.random.default_rng(n)
        q, k, v = (
            jnp.asarray(rng.standard_normal((batch, n, heads, dim)), jnp.float32).astype(BF16)
            for _ in range(3)
        )
        for causal in (False, True):

            def model(q, k, v, causal=causal):
                return naive_attention(q, k, v, causal)

            def by_hand(q, k, v, causal=causal):
                return cudnn_attention(q, k, v, causal)

            opt = flashpass.optimize(model)
            kernel = ",".join(opt.explain(q, k, v).kernels) or "none"
            flops = 4 * batch * heads * n * n * dim * (0.5 if causal else 1.0)
            for mode, wrap, scale in (("fwd", lambda f: f, 1.0), ("fwd+bwd", _fwd_bwd, 3.5)):
                cells = []
                ms = {}
                for name, fn in (("naive", model), ("flashpass", opt), ("cudnn", by_hand)):
                    try:
                        ms[name] = _median_ms(jax.jit(wrap(fn)), (q, k, v), reps)
                        tflops = flops * scale / (ms[name] * 1e-3) / 1e12
                        cell = f"{ms[name]:.2f} ({tflops:.0f})"
                    except Exception as err:  # OOM for the naive version at long S
                        ms[name] = None
                        cell = type(err).__name__
                    if name == "flashpass":
                        cell += f" [{kernel}]"
                    cells.append(cell)

                def ratio(a, b, ms=ms):
                    return f"{ms[b] / ms[a]:.2f}x" if ms[a] and ms[b] else "-"

                print(
                    f"| {n} | {'yes' if causal else 'no'} | {mode} | {' | '.join(cells)} "
                    f"| {ratio('flashpass', 'cudnn')} | {ratio('flashpass', 'naive')} |"
                )


# --------------------------------------------------------------------------- main


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu-check", action="store_true", help="correctness only, any host")
    ap.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args(argv)

    on_gpu = compat.gpu_compute_capability() is not None
    if args.cpu_check or not on_gpu:
        global _jit
        _jit = functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0})
    print(f"JAX {jax.__version__}, backend {jax.default_backend()}, cuDNN {compat.cudnn_version()}")
    ok = correctness(cpu_check=args.cpu_check)
    print("correctness:", "ok" if ok else "FAILED")
    if args.cpu_check:
        return 0 if ok else 1
    if not on_gpu:
        print("no GPU: the timing table needs one (use --cpu-check for correctness only)")
        return 0 if ok else 1
    timing(args.sizes, args.batch, args.heads, args.dim, args.reps)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
