"""Hypothesis strategies that write small attention-like programs as source code.

A drawn `Program` is one or two `Site`s; `Program.source()` renders it as a
plain Python function (``def program(q0, k0, v0, ...)``) that computes every
site the way real code spells attention, and `Program.build(seed)` execs that
source and draws the arguments.  Because the program *is* source text, a
failing example prints a self-contained reproducer (hypothesis shows it through
``note``), and a reproducer in a bug report is that text.

Three kinds of site:

* ``positive``: true attention, in random spellings — ``jnp.einsum`` /
  ``@`` / ``lax.dot_general`` for both products, either operand order, any
  axis layout of q, k, v, the scores and the output, BTNH/BNTH inputs, the
  grouped-query 5-D form, constant / ``sqrt`` / ``rsqrt`` / traced / pre-scaled
  scales, causal masks (``tril``, iota, ``arange``, a closed-over numpy buffer,
  additive ``triu``), boolean and additive input masks, biases, soft-caps,
  seven softmax spellings, float32 and bfloat16 inputs, T != S, batch and head
  sizes 1 and 2 (``jnp.matmul`` squeezes unit batch axes), and ``jit`` /
  ``checkpoint`` wrappers.  It must be rewritten and compute the original
  function.
* ``near_miss``: a positive site with one mutation that makes it *not*
  attention (softmax over another axis, P·V contracting the query axis, the
  probabilities or scores used again, an elementwise scale, P·V summing over
  heads, an unknown op, a mask on the probabilities, ...).  It must never be
  rewritten.
* ``lookalike``: a mutation that keeps the function attention but may trip a
  matcher that pattern-matches spelling (a permuted K or V layout, a constant
  mask that is almost causal, a per-query scale, negated scores, ...).  It may
  or may not be rewritten; if it is, the result must be exact, and a mask that
  is not causal must never become a `Causal` op.
"""

from __future__ import annotations

import dataclasses
import linecache

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st

from flashpass.compat import JAX_VERSION

# Tiny dimensions keep every example cheap.  B and H are 2 by default, sometimes
# 1 (B == H lets batch/head permutations type-check); the grouped form has H
# key/value heads of G = 2 query heads each; T == S in some shapes so that
# contraction mistakes type-check too.
B = 2
H = 2
G = 2
D = 4
SHAPES = ((4, 4), (3, 5), (5, 3))  # (T, S)

FILLS = {
    "-inf": "-jnp.inf",
    "finfo": "jnp.finfo(s.dtype).min",
    "-1e9": "-1e9",
    "-1e4": "-1e4",
}

SCALES = ("none", "mul", "div_sqrt", "math_sqrt", "rsqrt", "pow", "prescale_q", "prescale_k")
SOFTMAXES = ("nn", "stable", "stopgrad", "unstable", "recip", "log_softmax", "deferred")
CAUSAL_KINDS = ("tril", "iota", "arange", "buffer", "additive")
MASK_KINDS = (*CAUSAL_KINDS, "padding", "full_mask", "padding_additive")
BIAS_KINDS = ("full", "heads", "keys", "ts", "alibi")

NEAR_MISSES = (
    "softmax_over_query",
    "softmax_over_heads",
    "pv_contracts_query",
    "probs_returned",
    "probs_reused",
    "scores_reused",
    "scale_by_tensor",
    "scale_varies_along_keys",
    "pv_sums_heads",
    "unknown_op",
    "mask_on_probs",
    "bias_on_probs",
    "double_softmax",
    "shift_varies_along_keys",
    "normalised_over_query",
    "unnormalised",
    "deferred_by_wrong_sum",
    "p_times_p",
)

LOOKALIKES = (
    "permuted_k",
    "permuted_v",
    "anti_causal",
    "band",
    "strictly_lower",
    "flipped_causal",
    "weak_fill_causal",
    "weak_additive_causal",
    "scale_per_query",
    "negated_scores",
    "bias_constant_along_keys",
    "causal_then_zero_fill",
)

#: Mutations that need T == S.
SQUARE_ONLY = {
    "pv_contracts_query",
    "p_times_p",
    "deferred_by_wrong_sum",
    "causal_then_zero_fill",
    "anti_causal",
    "band",
    "strictly_lower",
    "flipped_causal",
    "weak_fill_causal",
    "weak_additive_causal",
}

#: Lookalike masks that must never be classified as a `Causal` op.
NOT_CAUSAL = {
    "anti_causal",
    "band",
    "strictly_lower",
    "flipped_causal",
    "weak_fill_causal",
    "weak_additive_causal",
}


@dataclasses.dataclass(frozen=True)
class Mask:
    kind: str  # one of MASK_KINDS
    fill: str  # key of FILLS
    form: str = "where"  # "where" | "where_not" (fill in the first branch)
    bottom_right: bool = False  # causal offset S - T (decode style)


@dataclasses.dataclass(frozen=True)
class Site:
    """Every choice that defines one attention site (hashable, printable)."""

    dtype: str = "float32"  # "float32" | "bfloat16" | "mixed" (bf16 in, f32 softmax)
    gqa: bool = False
    q_layout: str = "bthd"
    k_layout: str = "bshd"
    v_layout: str = "bshe"
    scores_product: str = "einsum"  # einsum | matmul | dot_general
    k_first: bool = False
    scores_layout: str = "bhts"  # einsum output order (others: implied)
    scale: str = "none"
    scale_after: bool = False  # the scale after the masks/bias instead of before
    traced_scale: bool = False
    masks: tuple = ()
    and_masks: bool = False  # several masks combined with & into one where
    bias: str | None = None
    bias_sign: int = 1
    softcap: float | None = None
    softmax: str = "nn"
    output_product: str = "einsum"
    v_first: bool = False
    out_layout: str = "bthe"
    wrap: str = "none"  # none | jit | checkpoint
    t: int = 4
    s: int = 4
    b: int = B
    h: int = H  # heads (key/value heads in the grouped form)
    mutation: str | None = None


@dataclasses.dataclass(frozen=True)
class Program:
    sites: tuple
    kind: str  # "positive" | "near_miss" | "lookalike" | "mixed"

    @property
    def expected_rewrites(self) -> int | None:
        """Exact number of sites that must be rewritten (None: not determined)."""
        if any(s.mutation in LOOKALIKES for s in self.sites):
            return None
        return sum(s.mutation is None for s in self.sites)

    def source(self) -> str:
        return render(self)

    def reproducer(self, seed: int = 0, kernel: str = "reference") -> str:
        """A standalone script: the program, its arguments, and the check."""
        lines = [self.source(), "", f"def make_args(seed={seed}):"]
        lines.append("    rng = np.random.default_rng(seed)")
        lines.append("    out = []")
        for i, site in enumerate(self.sites):
            for _, shape, kind, key_axis in _arg_specs_with_key_axis(site, i):
                lines.append(f"    out.append(_arg(rng, {shape!r}, {kind!r}, {key_axis}))")
        lines.append("    return tuple(out)")
        lines += ["", "", _ARG_SOURCE, "", _MAIN_SOURCE.replace("KERNEL", repr(kernel))]
        return "\n".join(lines)

    def build(self, seed: int):
        """``(fn, args)``: the compiled program and arguments drawn with ``seed``."""
        src = self.source()
        filename = f"<attention-program-{abs(hash(src))}>"
        # Register the text so tracebacks and source locations can show it.
        linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)
        namespace: dict = {}
        exec(compile(src, filename, "exec"), namespace)
        return namespace["program"], make_args(self, seed)


# --------------------------------------------------------------------------- sizes


def _sizes(site: Site) -> dict:
    return {"b": site.b, "h": site.h, "k": site.h, "g": G, "t": site.t, "s": site.s, "d": D, "e": D}


def _heads_q(site: Site) -> str:
    return "kg" if site.gqa else "h"


def _heads_kv(site: Site) -> str:
    return "k" if site.gqa else "h"


def k_letters(site: Site) -> str:
    """How the score product reads k's axes (a permuted-K lookalike relabels two)."""
    if site.mutation == "permuted_k":
        hkv = _heads_kv(site)
        return site.k_layout.translate(str.maketrans("b" + hkv, hkv + "b"))
    return site.k_layout


def scores_letters(site: Site) -> str:
    """Axis letters of the scores as the score product lays them out."""
    ql, kl, hq = site.q_layout, k_letters(site), _heads_q(site)
    if site.scores_product == "einsum":
        return site.scores_layout
    if site.scores_product == "dot_general":
        batch = [c for c in ql if c in kl and c != "d"]
        lhs_l, rhs_l = (kl, ql) if site.k_first else (ql, kl)
        free = [c for c in lhs_l if c not in batch and c != "d"]
        free += [c for c in rhs_l if c not in batch and c != "d"]
        return "".join(batch) + "".join(free)
    return "b" + hq + ("st" if site.k_first else "ts")


def arg_specs(site: Site, i: int) -> list[tuple[str, tuple, str]]:
    """``(name, shape, kind)`` of every argument of site ``i``."""
    sz = _sizes(site)
    in_dtype = "float32" if site.dtype == "float32" else "bfloat16"
    specs = [
        (f"q{i}", tuple(sz[c] for c in site.q_layout), in_dtype),
        (f"k{i}", tuple(sz[c] for c in site.k_layout), in_dtype),
        (f"v{i}", tuple(sz[c] for c in site.v_layout), in_dtype),
    ]
    sl = scores_letters(site)

    def shaped(keep):
        return tuple(sz[c] if c in keep else 1 for c in sl)

    for j, m in enumerate(site.masks):
        if m.kind == "padding":
            specs.append((f"pad{i}_{j}", (site.b, site.s), "padding"))
        elif m.kind == "padding_additive":
            specs.append((f"pad{i}_{j}", (site.b, site.s), "padding"))
        elif m.kind == "full_mask":
            specs.append((f"mask{i}_{j}", shaped("bts"), "mask"))
    if site.bias in ("full", "heads", "keys", "ts"):
        keep = {"full": "b" + _heads_q(site) + "ts", "heads": _heads_q(site) + "ts"}.get(
            site.bias, {"keys": "bs", "ts": "ts"}.get(site.bias)
        )
        specs.append((f"bias{i}", shaped(keep), "float32"))
    if site.traced_scale:
        specs.append((f"temp{i}", (), "temperature"))
    mut = site.mutation
    if mut == "scale_by_tensor":
        specs.append((f"w{i}", shaped(sl), "positive"))
    if mut == "bias_on_probs":
        specs.append((f"pb{i}", shaped("ts"), "float32"))
    if mut == "scale_per_query":
        specs.append((f"w{i}", shaped("t"), "positive"))
    return specs


def _arg(rng, shape, kind, key_axis=-1):
    """One argument: ``kind`` is a dtype name or one of the special kinds below."""
    if kind == "padding":  # [B, S] key padding, every row keeps key 0
        lengths = rng.integers(1, shape[1] + 1, size=shape[0])
        return jnp.asarray(np.arange(shape[1])[None, :] < lengths[:, None])
    if kind == "mask":  # random boolean mask; every query keeps key 0
        m = rng.random(shape) < 0.6
        index = [slice(None)] * len(shape)
        index[key_axis] = 0
        m[tuple(index)] = True
        return jnp.asarray(m)
    if kind == "temperature":
        return jnp.float32(rng.uniform(0.5, 3.0))
    if kind == "positive":
        return jnp.asarray(rng.uniform(0.5, 1.5, shape).astype(np.float32))
    return jnp.asarray(rng.standard_normal(shape).astype(np.float32)).astype(kind)


_ARG_SOURCE = "\n".join(
    line for line in __import__("inspect").getsource(_arg).splitlines() if line.strip()
)

_MAIN_SOURCE = """\
if __name__ == "__main__":
    import flashpass

    args = make_args()
    opt = flashpass.optimize(program, kernel=KERNEL)
    print(opt.explain(*args))
    ref, out = program(*args), opt(*args)
    for a, b in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(ref)):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        print("max |optimized - original| =", np.nanmax(np.abs(a - b)),
              "; NaN positions differ:", int((np.isnan(a) != np.isnan(b)).sum()))
"""


def make_args(program: Program, seed: int) -> tuple:
    rng = np.random.default_rng(seed)
    return tuple(
        _arg(rng, shape, kind, key_axis)
        for i, site in enumerate(program.sites)
        for _, shape, kind, key_axis in _arg_specs_with_key_axis(site, i)
    )


def _arg_specs_with_key_axis(site: Site, i: int):
    key_axis = scores_letters(site).index("s")
    return [(n, shape, kind, key_axis) for n, shape, kind in arg_specs(site, i)]


# --------------------------------------------------------------------------- rendering


def _index(src: str, dst: str) -> str:
    """Index expression placing an array laid out ``src`` (a subsequence of
    ``dst``'s letters, in ``dst`` order) into rank ``len(dst)`` with size-1 axes."""
    return "[" + ", ".join(":" if c in src else "None" for c in dst) + "]"


def _to_order(expr: str, src: str, dst_letters: str) -> str:
    """``expr`` (laid out ``src``) transposed so its axes follow ``dst_letters`` order."""
    order = [c for c in dst_letters if c in src]
    if "".join(order) == src:
        return expr
    perm = tuple(src.index(c) for c in order)
    return f"jnp.transpose({expr}, {perm})"


def _causal_matrix(kind: str, offset_expr: str) -> list[str]:
    """Lines defining ``cm`` ([T, S] bool, True = keep) for a causal mask spelling."""
    if kind == "tril":
        return [f"cm = jnp.tril(jnp.ones((T, S), dtype=bool), k={offset_expr})"]
    if kind == "iota":
        return [
            "qi = lax.broadcasted_iota(jnp.int32, (T, S), 0)",
            "ki = lax.broadcasted_iota(jnp.int32, (T, S), 1)",
            f"cm = ki <= qi + {offset_expr}",
        ]
    if kind == "arange":
        return [f"cm = jnp.arange(S)[None, :] <= jnp.arange(T)[:, None] + {offset_expr}"]
    if kind == "buffer":
        return [f"cm = jnp.asarray(np.tril(np.ones((T, S), dtype=bool), k={offset_expr}))"]
    raise ValueError(kind)


class _Writer:
    def __init__(self):
        self.lines: list[str] = []
        self.prelude: list[str] = []  # module-level constants
        self.n = 0

    def emit(self, line: str, indent: int = 1) -> None:
        self.lines.append("    " * indent + line)

    def fresh(self, stem: str) -> str:
        self.n += 1
        return f"{stem}_{self.n}"


def render(program: Program) -> str:
    w = _Writer()
    params = []
    outs = []
    for i, site in enumerate(program.sites):
        params += [name for name, _, _ in arg_specs(site, i)]
        names = [name for name, _, _ in arg_specs(site, i)]
        fname = f"site{i}"
        w.lines.append(f"def {fname}({', '.join(names)}):")
        _render_site(w, site, i)
        w.lines.append("")
        w.lines.append("")
        if site.wrap == "jit":
            call = f"jax.jit({fname})"
        elif site.wrap == "checkpoint":
            call = f"jax.checkpoint({fname})"
        else:
            call = fname
        outs.append(f"{call}({', '.join(names)})")
    body = [f"def program({', '.join(params)}):"]
    if len(outs) == 1:
        body.append(f"    return {outs[0]}")
    else:
        body.append(f"    return ({', '.join(outs)},)")
    header = [
        "import math",
        "",
        "import jax",
        "import jax.numpy as jnp",
        "import numpy as np",
        "from jax import lax",
        "",
        "",
    ]
    return "\n".join(header + w.prelude + w.lines + body) + "\n"


def _render_site(w: _Writer, site: Site, i: int) -> None:  # noqa: C901 - a flat recipe
    mut = site.mutation
    hq, hkv = _heads_q(site), _heads_kv(site)
    q, k, v = f"q{i}", f"k{i}", f"v{i}"
    w.emit(f"T, S = {site.t}, {site.s}")
    if site.scale == "prescale_q":
        w.emit(f"{q} = {q} * ({D} ** -0.5)")
    elif site.scale == "prescale_k":
        w.emit(f"{k} = {k} / math.sqrt({D})")

    # ---- scores
    sl = _scores(w, site, q, k, k_letters(site))

    # ---- score ops, in a random but supported order
    ops = []
    if site.traced_scale:
        ops.append("traced")
    scale_op = site.scale if site.scale not in ("none", "prescale_q", "prescale_k") else None
    if scale_op and not site.scale_after:
        ops.append("scale")
    if mut == "negated_scores":
        ops.append("negate")
    if mut == "bias_constant_along_keys":
        ops.append("row_bias")
    if site.bias:
        ops.append("bias")
    if site.masks:
        ops.append("masks")
    if mut in ("anti_causal", "band", "strictly_lower", "flipped_causal", "weak_fill_causal"):
        ops.append("const_mask")
    if mut in ("weak_additive_causal",):
        ops.append("weak_additive")
    if mut == "causal_then_zero_fill":
        ops.append("zero_fill")
    if scale_op and site.scale_after:
        ops.append("scale")
    if site.softcap:
        ops.append("softcap")
    if mut == "scale_by_tensor":
        ops.append("tensor_scale")
    if mut == "scale_varies_along_keys":
        ops.append("key_scale")
    if mut == "scale_per_query":
        ops.append("query_scale")
    if mut == "unknown_op":
        ops.append("abs")
    for op in ops:
        _score_op(w, site, op, sl, i)
    if mut == "scores_reused":
        w.emit("s_raw = s")
    if mut == "double_softmax":
        w.emit(f"s = jax.nn.softmax(s, axis={sl.index('s')})")

    # ---- softmax
    if site.dtype == "mixed":
        w.emit("s = s.astype(jnp.float32)")
    if mut == "softmax_over_query":
        ax = sl.index("t")
    elif mut == "softmax_over_heads":
        ax = sl.index(hq[-1])
    else:
        ax = sl.index("s")
    deferred = _softmax(w, site, ax, sl)
    if site.dtype == "mixed":
        w.emit(f"p = p.astype({v}.dtype)")
    if mut == "mask_on_probs":
        w.emit("p = jnp.where(" + _causal_mask_expr(w, "tril", "0", sl) + ", p, 0.0)")
    if mut == "bias_on_probs":
        w.emit(f"p = p + pb{i}")

    # ---- output
    v_letters = site.v_layout
    if mut == "permuted_v":
        v_letters = v_letters.translate(str.maketrans("b" + hkv, hkv + "b"))
    out_l = _output(w, site, v, v_letters, sl)
    if deferred:
        if mut == "deferred_by_wrong_sum":
            w.emit(f"total = jnp.sum(p, axis={sl.index('t')})")
            kept = [c for c in sl if c != "t"]
        else:
            kept = [c for c in sl if c != "s"]
        # total is laid out `kept`; bring it to the output layout (e is new, size 1)
        src = "".join(kept)
        want = out_l.replace("e", "")
        expr = _to_order("total", src, want)
        if mut == "deferred_by_wrong_sum":
            # the wrong sum has the key axis where the output has the query axis
            want = want.replace("t", "s")
            expr = _to_order("total", src.replace("t", "s"), want.replace("t", "s"))
        w.emit(f"out = out / jnp.expand_dims({expr}, {out_l.index('e')})")
    if mut == "probs_returned":
        w.emit("return out, p")
        return
    if mut == "probs_reused":
        w.emit("out = out + jnp.mean(p).astype(out.dtype)")
    if mut == "scores_reused":
        w.emit("out = out + jnp.mean(s_raw).astype(out.dtype)")
    w.emit("return out")


def _scores(w: _Writer, site: Site, q: str, k: str, kl: str) -> str:
    ql = site.q_layout
    sl = scores_letters(site)
    if site.scores_product == "einsum":
        if site.k_first:
            w.emit(f's = jnp.einsum("{kl},{ql}->{sl}", {k}, {q})')
        else:
            w.emit(f's = jnp.einsum("{ql},{kl}->{sl}", {q}, {k})')
    elif site.scores_product == "dot_general":
        batch = [c for c in ql if c in kl and c != "d"]
        lhs_l, rhs_l, lhs, rhs = (kl, ql, k, q) if site.k_first else (ql, kl, q, k)
        dims = (
            ((lhs_l.index("d"),), (rhs_l.index("d"),)),
            (tuple(lhs_l.index(c) for c in batch), tuple(rhs_l.index(c) for c in batch)),
        )
        w.emit(f"s = lax.dot_general({lhs}, {rhs}, {dims})")
    else:
        # matmul: (b, heads, t, d) @ (b, heads, d, s), GQA via a broadcast group axis
        qt = _to_order(q, ql, "b" + _heads_q(site) + "td")
        kt = _to_order(k, kl, "b" + _heads_kv(site) + "sd")
        if site.gqa:
            kt = f"{kt}[:, :, None]"
        if site.k_first:
            w.emit(f"s = jnp.matmul({kt}, jnp.swapaxes({qt}, -1, -2))")
        else:
            w.emit(f"s = {qt} @ jnp.swapaxes({kt}, -1, -2)")
    return sl


def _causal_mask_expr(w: _Writer, kind: str, offset: str, sl: str) -> str:
    for line in _causal_matrix(kind, offset):
        w.emit(line)
    cm = _to_order("cm", "ts", sl)
    return f"{cm}{_index('ts', sl)}"


def _fill(site: Site, key: str) -> str:
    return FILLS[key]


def _score_op(w: _Writer, site: Site, op: str, sl: str, i: int) -> None:
    hq = _heads_q(site)
    if op == "traced":
        w.emit(f"s = s / temp{i}")
    elif op == "scale":
        w.emit(
            {
                "mul": "s = s * 0.37",
                "div_sqrt": f"s = s / jnp.sqrt({D}).astype(s.dtype)",
                "math_sqrt": f"s = s / math.sqrt({D})",
                "rsqrt": f"s = s * lax.rsqrt(jnp.float32({D})).astype(s.dtype)",
                "huge": "s = s * 100.0",
                "pow": f"s = s * {D} ** -0.5",
            }[site.scale]
        )
    elif op == "negate":
        w.emit("s = -s")
    elif op == "row_bias":
        # constant along the key axis: softmax ignores it (still attention)
        w.emit(f"s = s + (jnp.arange(T, dtype=s.dtype) * 0.1){_index('t', sl)}")
    elif op == "bias":
        sign = "+" if site.bias_sign > 0 else "-"
        if site.bias == "alibi":
            hl = hq[-1]
            n = G if site.gqa else site.h
            keep = "".join(c for c in sl if c in (hl, "t", "s"))
            w.emit(f"slopes = jnp.asarray([2.0 ** -(j + 1) for j in range({n})], jnp.float32)")
            w.emit("dist = jnp.abs(jnp.arange(T)[:, None] - jnp.arange(S)[None, :])")
            w.emit("alibi = -slopes[:, None, None] * dist[None]")  # (h, t, s)
            expr = _to_order("alibi", hl + "ts", keep)
            w.emit(f"s = s {sign} {expr}{_index(keep, sl)}.astype(s.dtype)")
        else:
            w.emit(f"s = s {sign} bias{i}.astype(s.dtype)")
    elif op == "masks":
        conds = []
        for j, m in enumerate(site.masks):
            offset = "S - T" if m.bottom_right else "0"
            fill = _fill(site, m.fill)
            if m.kind == "additive":
                w.emit(f"addm = jnp.triu(jnp.full((T, S), {fill}, s.dtype), k={offset} + 1)")
                w.emit(f"s = s + {_to_order('addm', 'ts', sl)}{_index('ts', sl)}")
                continue
            if m.kind == "padding_additive":
                w.emit(f"addp = jnp.where(pad{i}_{j}, 0.0, {fill}).astype(s.dtype)")
                w.emit(f"s = s + {_to_order('addp', 'bs', sl)}{_index('bs', sl)}")
                continue
            if m.kind in CAUSAL_KINDS:
                cond = _causal_mask_expr(w, m.kind, offset, sl)
            elif m.kind == "padding":
                cond = f"{_to_order(f'pad{i}_{j}', 'bs', sl)}{_index('bs', sl)}"
            else:
                cond = f"mask{i}_{j}"
            if site.and_masks:
                conds.append((cond, fill, m.form))
                continue
            _where(w, cond, fill, m.form)
        if conds:
            name = w.fresh("keep")
            w.emit(f"{name} = " + " & ".join(c for c, _, _ in conds))
            _where(w, name, conds[0][1], conds[0][2])
    elif op == "const_mask":
        mut = site.mutation
        t, s = site.t, site.s
        keep = np.tril(np.ones((t, s), bool))
        fill = "-1e9"
        if mut == "anti_causal":
            keep = np.triu(np.ones((t, s), bool))
            keep[:, -1] = True
        elif mut == "band":
            keep = keep & np.triu(np.ones((t, s), bool), k=-1)
        elif mut == "strictly_lower":
            keep = np.tril(np.ones((t, s), bool), k=-1)
            fill = "-jnp.inf"
        elif mut == "flipped_causal":
            keep = keep.copy()
            keep[0, s - 1] = True
        elif mut == "weak_fill_causal":
            fill = "-5.0"
        const = f"KEEP{i}"
        rows = ", ".join("[" + ", ".join(str(bool(x)) for x in row) + "]" for row in keep)
        w.prelude.append(f"{const} = np.array([{rows}])")
        w.prelude.append("")
        cond = f"{_to_order(f'jnp.asarray({const})', 'ts', sl)}{_index('ts', sl)}"
        _where(w, cond, fill, "where")
    elif op == "weak_additive":
        w.emit("addm = jnp.triu(jnp.full((T, S), -10.0, s.dtype), k=1)")
        w.emit(f"s = s + {_to_order('addm', 'ts', sl)}{_index('ts', sl)}")
    elif op == "zero_fill":
        cond = _causal_mask_expr(w, "tril", "0", sl)
        _where(w, cond, "-1e9", "where")
        # ...then one masked entry, query 0 / last key, is set back to 0.0: that key
        # is no longer excluded, so a kernel may not skip it
        w.emit("qi2 = lax.broadcasted_iota(jnp.int32, (T, S), 0)")
        w.emit("ki2 = lax.broadcasted_iota(jnp.int32, (T, S), 1)")
        w.emit("hole = (ki2 != S - 1) | (qi2 != 0)")
        cond2 = f"{_to_order('hole', 'ts', sl)}{_index('ts', sl)}"
        _where(w, cond2, "0.0", "where")
    elif op == "softcap":
        w.emit(f"s = {site.softcap} * jnp.tanh(s / {site.softcap})")
    elif op == "tensor_scale":
        w.emit(f"s = s * w{i}.astype(s.dtype)")
    elif op == "key_scale":
        w.emit(f"ramp = jnp.linspace(0.5, 1.5, S).astype(s.dtype){_index('s', sl)}")
        w.emit("s = s * ramp")
    elif op == "query_scale":
        w.emit(f"s = s * w{i}.astype(s.dtype)")
    elif op == "abs":
        w.emit("s = jnp.abs(s)")
    else:  # pragma: no cover
        raise ValueError(op)


def _where(w: _Writer, cond: str, fill: str, form: str) -> None:
    if form == "where_not":
        w.emit(f"s = jnp.where(~({cond}), {fill}, s)")
    else:
        w.emit(f"s = jnp.where({cond}, s, {fill})")


def _softmax(w: _Writer, site: Site, ax: int, sl: str) -> bool:
    """Lines computing ``p`` from ``s`` over axis ``ax``; True if normalisation is deferred."""
    mut = site.mutation
    kind = site.softmax
    if mut == "shift_varies_along_keys":
        other = sl.index("t")
        w.emit(f"e = jnp.exp(s - jnp.max(s, axis={other}, keepdims=True))")
        w.emit(f"p = e / jnp.sum(e, axis={ax}, keepdims=True)")
        return False
    if mut == "normalised_over_query":
        other = sl.index("t")
        w.emit(f"e = jnp.exp(s - jnp.max(s, axis={ax}, keepdims=True))")
        w.emit(f"p = e / jnp.sum(e, axis={other}, keepdims=True)")
        return False
    if mut == "unnormalised":
        w.emit(f"p = jnp.exp(s - jnp.max(s, axis={ax}, keepdims=True))")
        return False
    if kind == "nn":
        w.emit(f"p = jax.nn.softmax(s, axis={ax})")
    elif kind == "stable":
        w.emit(f"e = jnp.exp(s - jnp.max(s, axis={ax}, keepdims=True))")
        w.emit(f"p = e / jnp.sum(e, axis={ax}, keepdims=True)")
    elif kind == "stopgrad":
        w.emit(f"e = jnp.exp(s - lax.stop_gradient(s.max({ax}, keepdims=True)))")
        w.emit(f"p = e * (1.0 / e.sum({ax}, keepdims=True))")
    elif kind == "unstable":
        w.emit("e = jnp.exp(s)")
        w.emit(f"p = e / e.sum(axis={ax}, keepdims=True)")
    elif kind == "recip":
        w.emit(f"e = jnp.exp(s - s.max(axis={ax}, keepdims=True))")
        w.emit(f"p = e * jnp.reciprocal(jnp.sum(e, axis={ax}, keepdims=True))")
    elif kind == "log_softmax":
        w.emit(f"p = jnp.exp(jax.nn.log_softmax(s, axis={ax}))")
    elif kind == "deferred":
        w.emit(f"p = jnp.exp(s - lax.stop_gradient(s.max({ax}, keepdims=True)))")
        w.emit(f"total = jnp.sum(p, axis={ax})")
        return True
    else:  # pragma: no cover
        raise ValueError(kind)
    return False


def _output(w: _Writer, site: Site, v: str, v_letters: str, sl: str) -> str:
    mut = site.mutation
    hq = _heads_q(site)
    p = "p"
    if mut == "p_times_p":
        # P·P: the second factor is the probabilities, not values
        vl = sl.replace("s", "u").replace("t", "s")
        ol = sl.replace("s", "u")
        w.emit(f'out = jnp.einsum("{sl},{vl}->{ol}", p, p)')
        return ol
    if mut == "pv_contracts_query":
        vl = v_letters.replace("s", "t")
        ol = site.out_layout.replace("t", "s")
        w.emit(f'out = jnp.einsum("{sl},{vl}->{ol}", {p}, {v})')
        return ol
    if mut == "pv_sums_heads":
        vl = v_letters
        ol = site.out_layout.replace(hq[-1], "")
        w.emit(f'out = jnp.einsum("{sl},{vl}->{ol}", {p}, {v})')
        return ol
    if site.output_product == "einsum":
        ol = site.out_layout
        if site.v_first:
            w.emit(f'out = jnp.einsum("{v_letters},{sl}->{ol}", {v}, {p})')
        else:
            w.emit(f'out = jnp.einsum("{sl},{v_letters}->{ol}", {p}, {v})')
        return ol
    if site.output_product == "dot_general":
        batch = [c for c in sl if c in v_letters and c != "s"]
        lhs_l, rhs_l, lhs, rhs = (v_letters, sl, v, p) if site.v_first else (sl, v_letters, p, v)
        dims = (
            ((lhs_l.index("s"),), (rhs_l.index("s"),)),
            (tuple(lhs_l.index(c) for c in batch), tuple(rhs_l.index(c) for c in batch)),
        )
        w.emit(f"out = lax.dot_general({lhs}, {rhs}, {dims})")
        free = [c for c in lhs_l if c not in batch and c != "s"]
        free += [c for c in rhs_l if c not in batch and c != "s"]
        return "".join(batch) + "".join(free)
    pt = _to_order(p, sl, "b" + hq + "ts")
    vt = _to_order(v, v_letters, "b" + _heads_kv(site) + "se")
    if site.gqa:
        vt = f"{vt}[:, :, None]"
    if site.v_first:
        # (vᵀ pᵀ)ᵀ: the values as the left operand
        vp = f"jnp.swapaxes({vt}, -1, -2) @ jnp.swapaxes({pt}, -1, -2)"
        w.emit(f"out = jnp.swapaxes({vp}, -1, -2)")
    else:
        w.emit(f"out = {pt} @ {vt}")
    return "b" + hq + "te"


# --------------------------------------------------------------------------- strategies


def _perm(letters: str):
    return st.permutations(list(letters)).map("".join)


@st.composite
def sites(
    draw, kind: str = "positive", mutations=None, max_masks: int = 2, region: str | None = None
) -> Site:
    """One `Site` of ``kind`` ("positive", "near_miss" or "lookalike").

    ``region`` names one of `REGIONS`: the site is moved into it (for the
    property tests that focus on it).
    """
    gqa = draw(st.integers(0, 3)) == 0
    hq = "kg" if gqa else "h"
    hkv = "k" if gqa else "h"
    t, s = draw(st.sampled_from(SHAPES))
    mutation = None
    if kind == "near_miss":
        mutation = draw(st.sampled_from(mutations or NEAR_MISSES))
    elif kind == "lookalike":
        mutation = draw(st.sampled_from(mutations or LOOKALIKES))
    if mutation in SQUARE_ONLY:
        t = s = 4
    b = draw(st.sampled_from((2, 2, 2, 1)))
    h = draw(st.sampled_from((2, 2, 2, 1)))
    if mutation in ("permuted_k", "permuted_v"):
        gqa = False
        hq = hkv = "h"
        b = h = 2

    def layout(letters, common):
        if draw(st.integers(0, 4)) == 0:
            return draw(_perm(letters))
        return draw(st.sampled_from(common))

    q_layout = layout("b" + hq + "td", ["bt" + hq + "d", "b" + hq + "td"])
    k_layout = layout("b" + hkv + "sd", ["bs" + hkv + "d", "b" + hkv + "sd"])
    v_layout = layout("b" + hkv + "se", ["bs" + hkv + "e", "b" + hkv + "se"])
    scores_product = draw(st.sampled_from(("einsum", "matmul", "dot_general")))
    k_first = draw(st.booleans())
    scores_layout = "b" + hq + "ts"
    if scores_product == "einsum" and draw(st.booleans()):
        scores_layout = draw(_perm("b" + hq + "ts"))
    dtype = draw(st.sampled_from(("float32", "float32", "bfloat16", "mixed")))
    scale = draw(st.sampled_from(SCALES))
    scale_after = draw(st.booleans())
    traced_scale = draw(st.integers(0, 5)) == 0

    masks = []
    n_masks = draw(st.integers(0, max_masks))
    if mutation in NOT_CAUSAL or mutation in ("causal_then_zero_fill", "mask_on_probs"):
        n_masks = 0  # the mutation brings its own mask
    for _ in range(n_masks):
        mk = draw(st.sampled_from(MASK_KINDS))
        if mk in CAUSAL_KINDS and any(m.kind in CAUSAL_KINDS for m in masks):
            continue
        fill = draw(st.sampled_from(tuple(FILLS)))
        if mk in ("additive", "padding_additive") and fill == "finfo":
            fill = "-1e9"  # finfo.min + finfo.min overflows to -inf differently in bf16
        bottom_right = mk in CAUSAL_KINDS and t <= s and draw(st.booleans())
        form = draw(st.sampled_from(("where", "where_not")))
        masks.append(Mask(mk, fill, form, bottom_right))
    and_masks = (
        len([m for m in masks if m.kind not in ("additive", "padding_additive")]) > 1
        and len({m.fill for m in masks}) == 1
        and len({m.form for m in masks}) == 1
        and draw(st.booleans())
    )
    bias = draw(st.sampled_from((None, None, *BIAS_KINDS)))
    bias_sign = draw(st.sampled_from((1, -1)))
    softcap = draw(st.sampled_from((None, None, None, 5.0, 30.0)))
    softmax = draw(st.sampled_from(SOFTMAXES))
    output_product = draw(st.sampled_from(("einsum", "matmul", "dot_general")))
    v_first = draw(st.booleans())
    out_layout = draw(st.sampled_from(("bt" + hq + "e", "b" + hq + "te")))
    if output_product == "einsum" and draw(st.integers(0, 3)) == 0:
        out_layout = draw(_perm("b" + hq + "te"))
    wrap = draw(st.sampled_from(("none", "none", "none", "jit", "checkpoint")))

    # Keep only what the contract defines exactly (see the module docstring):
    if softmax == "deferred":
        # the division by the sum is matched on the P·V output; keep masks simple
        output_product = "einsum"
        out_layout = scores_layout.replace("s", "") + "e"
        v_first = False
    if mutation in ("pv_contracts_query", "pv_sums_heads"):
        softmax = "nn" if softmax == "deferred" else softmax
    if mutation == "deferred_by_wrong_sum":
        softmax = "deferred"
        dtype = "float32"
        scores_product = "einsum"
        scores_layout = "b" + hq + "ts"
        output_product = "einsum"
        out_layout = scores_layout.replace("s", "") + "e"
    if mutation in ("shift_varies_along_keys", "normalised_over_query", "unnormalised"):
        softmax = "stable"
    if softmax == "deferred" and mutation in (
        "scale_per_query",
        "softmax_over_query",
        "softmax_over_heads",
        "p_times_p",
        "mask_on_probs",
        "bias_on_probs",
        "probs_returned",
    ):
        softmax = "stable"
    site = Site(
        dtype=dtype,
        gqa=gqa,
        q_layout=q_layout,
        k_layout=k_layout,
        v_layout=v_layout,
        scores_product=scores_product,
        k_first=k_first,
        scores_layout=scores_layout,
        scale=scale,
        scale_after=scale_after,
        traced_scale=traced_scale,
        masks=tuple(masks),
        and_masks=and_masks,
        bias=bias,
        bias_sign=bias_sign,
        softcap=softcap,
        softmax=softmax,
        output_product=output_product,
        v_first=v_first,
        out_layout=out_layout,
        wrap=wrap,
        t=t,
        s=s,
        b=b,
        h=h,
        mutation=mutation,
    )
    if region is not None:
        site = REGIONS[region][1](avoid_known_gaps(site))
    return avoid_known_gaps(site)


# --------------------------------------------------------------------------- regions

#: Regions of the generator space with a property test of their own in
#: test_properties.py (``region=...``): id -> (description, move a site into
#: the region).  Each began as a bug these properties found.
REGIONS = {
    "mask_in_a_call_then_softcap": (
        "a constant additive causal mask built inside a call (jnp.triu(jnp.full(..., dtype))) "
        "followed by a soft-cap: the soft-cap undoes the causal fill, so the mask becomes a "
        "boolean extra read inside the triu call, which must be inlined to compute it (was "
        "BUG1: KeyError in the rewriter, the site fell back); the main generators cover it too",
        lambda site: dataclasses.replace(
            site,
            masks=(Mask("additive", "-inf"),),
            and_masks=False,
            softcap=5.0,
            b=2,
            h=2,
        ),
    ),
    "unstabilised_softmax_out_of_range": (
        "an unstabilised softmax exp(s) / sum(exp(s)) with scores beyond exp's range: it is "
        "rewritten to the stable softmax, so where the original's exp overflows (NaN) the "
        "rewrite computes exp(s - max) / sum (was BUG2; documented in docs/patterns.md); the "
        "main generators keep scores in range, where both agree",
        lambda site: dataclasses.replace(
            site, softmax="unstable", scale="huge", scale_after=False, dtype="float32"
        ),
    ),
}


# --------------------------------------------------------------------------- known gaps

#: Spellings of true attention that flashpass does not rewrite yet (coverage
#: gaps, not wrong results).  The generators repair them away so the
#: properties stay strict; tests/fuzz/test_known_gaps.py pins each one with a
#: strict xfail, so fixing a gap fails that test until the repair is removed.
#: Whether jnp.matmul squeezes unit batch axes (JAX 0.10+; see G5).
UNIT_AXIS_MATMUL = JAX_VERSION >= (0, 10)

KNOWN_GAPS = {
    "G5": "JAX 0.9 only: jnp.matmul with a size-1 batch or head axis keeps it as a unit free "
    "axis of the score product ('key operand of the score product has 2 free axes'); JAX "
    "0.10+ squeezes it, which is recognised",
}


def known_gap(site: Site) -> str | None:
    """The id of the first known gap ``site`` falls into, or None."""
    matmuls = (site.scores_product == "matmul") + (site.output_product == "matmul")
    if matmuls and 1 in (site.b, site.h) and not UNIT_AXIS_MATMUL:
        return "G5"
    return None


def avoid_known_gaps(site: Site) -> Site:
    """``site`` moved out of every known gap (nearest supported spelling)."""
    for _ in range(len(KNOWN_GAPS) + 1):
        gap = known_gap(site)
        if gap is None:
            return site
        if gap == "G5":
            site = dataclasses.replace(
                site,
                scores_product=site.scores_product.replace("matmul", "einsum"),
                output_product=site.output_product.replace("matmul", "einsum"),
            )
    raise AssertionError(f"cannot repair {site}")


def programs(kind: str = "positive", single: bool = False, **kwargs):
    """A `Program`: one site of ``kind``, sometimes two (kind "mixed": one
    positive and one near miss, in either order)."""
    if kind == "mixed":
        return st.tuples(sites("positive", **kwargs), sites("near_miss", **kwargs)).flatmap(
            lambda pair: st.permutations(list(pair)).map(lambda ps: Program(tuple(ps), "mixed"))
        )
    one = sites(kind, **kwargs).map(lambda s: Program((s,), kind))
    if kind != "positive" or single:
        return one
    two = st.tuples(sites(kind, **kwargs), sites(kind, **kwargs)).map(
        lambda ps: Program(tuple(ps), kind)
    )
    return st.one_of(one, one, one, two)


# --------------------------------------------------------------------------- checking


def tolerance(program: Program) -> float:
    low = any(s.dtype != "float32" for s in program.sites)
    return 3e-2 if low else 3e-5


def assert_same(out, ref, tol: float, context: str = "") -> None:
    out_leaves = jax.tree_util.tree_leaves(out)
    ref_leaves = jax.tree_util.tree_leaves(ref)
    assert len(out_leaves) == len(ref_leaves), context
    for a, b in zip(out_leaves, ref_leaves, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, a.dtype, b.shape, b.dtype)
        np.testing.assert_allclose(
            np.asarray(a, np.float32),
            np.asarray(b, np.float32),
            rtol=tol,
            atol=tol,
            equal_nan=True,
            err_msg=context,
        )


def score_ops(report) -> list[list[str]]:
    return [[op["op"] for op in r.spec["score_ops"]] for r in report.rewrites]


def has_causal_mask(site: Site) -> bool:
    return any(m.kind in CAUSAL_KINDS for m in site.masks) or site.mutation in (
        "causal_then_zero_fill",
        "mask_on_probs",
    )


__all__ = [
    "LOOKALIKES",
    "NEAR_MISSES",
    "NOT_CAUSAL",
    "Program",
    "Site",
    "assert_same",
    "has_causal_mask",
    "programs",
    "sites",
    "tolerance",
]
