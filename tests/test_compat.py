"""One test per private or experimental JAX API that flashpass/compat/ uses.

flashpass reaches into JAX internals (jaxpr classes, tracing, DCE, source info,
``shard_map`` equations) and experimental modules (Pallas kernels).  When a JAX
release moves or changes one of them, the pass must not quietly degrade (keep
every site, take a slow path, lose report locations): the test of that API
fails here, naming it and the installed JAX version.  The fix goes in
flashpass/compat/; nothing else imports these APIs.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flashpass import compat

from jax_versions import requires_triton


@contextlib.contextmanager
def uses(api: str):
    """Re-raise any failure in the block as an AssertionError naming ``api``
    and the installed JAX version."""
    try:
        yield
    except Exception as err:  # every failure names the API
        raise AssertionError(
            f"JAX {jax.__version__}: {api} moved or changed ({type(err).__name__}: {err}); "
            "update flashpass/compat/"
        ) from err


def _scan_jaxpr():
    def f(x, w):
        def body(c, y):
            return c * w + y, c

        return jax.lax.scan(body, x, jnp.ones((2, *x.shape)))

    return jax.make_jaxpr(f)(jnp.ones(3), jnp.ones(3))


# --------------------------------------------------------------------------- jaxpr classes


def test_jaxpr_classes():
    with uses("jax._src.core.Jaxpr / ClosedJaxpr (one class since JAX 0.11)"):
        closed = _scan_jaxpr()
        assert compat.is_body(closed)
        jaxpr, consts = compat.closed_parts(closed)
        assert [e.primitive.name for e in jaxpr.eqns][-1] == "scan"
        assert len(consts) == len(jaxpr.constvars)
        rebuilt = compat.closed_jaxpr(jaxpr, consts)
        assert compat.closed_parts(rebuilt)[0].eqns == jaxpr.eqns
        # a scan body is found, named and replaceable in its equation's params
        scan = jaxpr.eqns[-1]
        [(name, index, body)] = compat.bodies_in_params(scan.params)
        assert (name, index) == ("jaxpr", None) and compat.is_body(body)
        assert compat.subjaxprs_of_params(scan.params) == [body]
        new = compat.replace_bodies(scan.params, {(name, index): compat.as_closed(body)})
        assert compat.is_body(new["jaxpr"]) and new["length"] == scan.params["length"]
        assert compat.rebuild_body(scan, name, body, compat.as_closed(body)) is not None


def test_scan_counts():
    with uses("scan params: num_consts/num_carry (JAX < 0.11), ft_in (jax._src.flattree)"):

        def f(x, w, u):
            def body(c, y):
                return c * w + y * u, c

            return jax.lax.scan(body, x, jnp.ones((2, *x.shape)))

        closed = jax.make_jaxpr(f)(jnp.ones(3), jnp.ones(3), jnp.ones(3))
        [scan] = [e for e in compat.closed_parts(closed)[0].eqns if e.primitive.name == "scan"]
        assert compat.scan_counts(scan.params) == (2, 1)  # w, u; c; then xs


def test_leading_operands():
    """A scan or remat body given more leading inputs binds with them as new
    operands (a scan's constants): how a mask read outside reaches the body."""
    with uses("scan params: num_consts (JAX < 0.11), ft_in (jax._src.flattree.pack, nones)"):

        def f(x, w):
            y = jax.lax.scan(lambda c, _: (c * w, None), x, None, length=2)[0]
            return jax.checkpoint(lambda a: jnp.sin(a) * w)(y)

        x, w, extra = jnp.ones(3), jnp.full(3, 2.0), jnp.full(3, 0.5)
        closed = jax.make_jaxpr(f)(x, w)
        jaxpr, consts = compat.closed_parts(closed)
        env = dict(zip(jaxpr.invars, (x, w), strict=True))
        for eqn in jaxpr.eqns:
            invals = [
                env[v] if not compat.is_literal(v) else compat.literal_value(v) for v in eqn.invars
            ]
            [(name, index, body)] = compat.bodies_in_params(eqn.params)
            assert compat.threads_operands(eqn, name, index)
            inner, inner_consts = compat.closed_parts(compat.as_closed(body))

            def run(e, *args, inner=inner, inner_consts=inner_consts):
                return compat.eval_jaxpr(inner, inner_consts, *(a + e for a in args))

            avals = [jax.typeof(extra), *(v.aval for v in inner.invars)]
            new = compat.rebuild_body(eqn, name, body, jax.make_jaxpr(run)(*avals))
            params = compat.with_leading_operands(eqn, new, 1)
            outs = compat.bind_equation(eqn, [extra, *invals], params)
            env.update(zip(eqn.outvars, outs, strict=True))
        # every input of both bodies read 0.5 more: scan (x+.5)*(w+.5) twice, then sin
        c = (1.5 * 2.5 + 0.5) * 2.5
        np.testing.assert_allclose(env[jaxpr.outvars[0]], np.sin(c + 0.5) * 2.5, rtol=1e-6)


def test_open_bodies():
    """``remat``'s body is evaluated without constants: it stays constant-free."""
    with uses("jax._src.core.Jaxpr (open bodies: remat)"):
        closed = jax.make_jaxpr(jax.checkpoint(lambda x: jnp.sin(x) * 2))(jnp.ones(3))
        [eqn] = compat.closed_parts(closed)[0].eqns
        [(name, index, body)] = compat.bodies_in_params(eqn.params)
        assert index is None
        no_consts = compat.closed_jaxpr(compat.closed_parts(body)[0], ())
        assert compat.rebuild_body(eqn, name, body, no_consts) is not None
        c = jnp.arange(3.0)
        with_consts = jax.make_jaxpr(lambda x: jnp.sin(x) * c)(jnp.ones(3))
        assert compat.closed_parts(with_consts)[1]
        with pytest.raises(ValueError, match="close over constants"):
            compat.rebuild_body(eqn, name, body, with_consts)


def test_literals_and_dropped_outputs():
    with uses("jax._src.core.Literal / DropVar / Var"):
        closed = jax.make_jaxpr(lambda x: x * 2.0)(jnp.ones(3))
        [eqn] = compat.closed_parts(closed)[0].eqns
        literals = [a for a in eqn.invars if compat.is_literal(a)]
        assert literals and float(compat.literal_value(literals[0])) == 2.0
        assert not compat.is_literal(eqn.invars[0])
        assert compat.is_drop_var(compat.DropVar(eqn.outvars[0].aval))
        assert not compat.is_drop_var(eqn.outvars[0])


def test_eval_jaxpr():
    with uses("jax._src.core.eval_jaxpr"):
        closed = jax.make_jaxpr(lambda x: jnp.sin(x) + 1)(jnp.ones(3))
        jaxpr, consts = compat.closed_parts(closed)
        [out] = compat.eval_jaxpr(jaxpr, consts, jnp.zeros(3))
        np.testing.assert_allclose(out, np.ones(3))


# --------------------------------------------------------------------------- tracing


def test_bind_with_params():
    """The general path: `Primitive.get_bind_params`, the equation's context."""
    with uses("jax._src.core.Primitive.get_bind_params / JaxprEqn.ctx"):
        closed = _scan_jaxpr()
        scan = compat.closed_parts(closed)[0].eqns[-1]
        invals = [jnp.ones(v.aval.shape, v.aval.dtype) for v in scan.invars]
        out = compat.bind_equation(scan, invals, dict(scan.params))
        again = compat.bind_equation(scan, invals)
        for a, b in zip(out, again, strict=True):
            np.testing.assert_allclose(a, b)


def test_emit_fast_path():
    """Re-staging an unchanged equation skips ``bind`` (3x faster re-tracing)."""
    with uses("jax._src.interpreters.partial_eval.DynamicJaxprTrace.emit_eqn"):
        assert compat._CAN_EMIT, "emit_eqn's signature changed"
    with uses("jax._src.interpreters.partial_eval.DynamicJaxprTracer(trace, aval, val...)"):
        assert compat._CAN_EMIT_LITERALS, "DynamicJaxprTracer's signature changed"
    closed = jax.make_jaxpr(lambda x: jnp.sin(x) * 2.0)(jnp.ones(3))
    sin, mul = compat.closed_parts(closed)[0].eqns
    emitted = []

    def retrace(x):
        [y] = compat._emit_unchanged(sin, [x])
        emitted.append(compat._emit_unchanged(mul, [y, compat.literal_value(mul.invars[1])]))
        return emitted[-1][0]

    with uses("jax._src.core.trace_ctx.trace / DynamicJaxprTrace.emit_eqn"):
        again = jax.make_jaxpr(retrace)(jnp.ones(3))
        assert emitted[0] is not None
        assert [e.primitive.name for e in compat.closed_parts(again)[0].eqns] == ["sin", "mul"]


def test_compile_time_eval():
    """Constant folding inside an outer trace: `_core.set_current_trace` and
    `_core.eval_trace` make the eager evaluation trace current."""
    closed = jax.make_jaxpr(lambda x: x * 2.0)(jnp.ones(3))
    [mul] = compat.closed_parts(closed)[0].eqns
    results = []

    @jax.jit
    def outer(y):
        two = compat.literal_value(mul.invars[1])
        results.extend(compat.evaluate_equation(mul, [np.ones(3, np.float32), two]))
        return y

    with uses("jax._src.core.set_current_trace / jax._src.core.eval_trace"):
        outer(jnp.ones(2))
        [value] = results
        assert not isinstance(value, jax.core.Tracer), type(value)
        np.testing.assert_allclose(np.asarray(value), np.full(3, 2.0))


def test_dce():
    with uses("jax._src.interpreters.partial_eval.dce_jaxpr"):
        c = jnp.arange(3.0)  # closed over: a constant

        def f(x):
            jnp.cos(x)  # dead
            return jnp.sin(x) + c

        closed = jax.make_jaxpr(f)(jnp.ones(3))
        new = compat.dce_closed_jaxpr(closed)
        jaxpr, consts = compat.closed_parts(new)
        names = [e.primitive.name for e in jaxpr.eqns]
        assert "cos" not in names and "sin" in names
        old_jaxpr, old_consts = compat.closed_parts(closed)
        assert len(jaxpr.invars) == len(old_jaxpr.invars)
        assert len(consts) == len(old_consts) == len(jaxpr.constvars) == 1
        # Outputs flagged unused are dropped, with the equations only they need;
        # what is kept is the original's (the same equations and variables).
        two = jax.make_jaxpr(lambda x: (jnp.sin(x), jnp.cos(x)))(jnp.ones(3))
        first, _ = compat.closed_parts(compat.dce_closed_jaxpr(two, [True, False]))
        old, _ = compat.closed_parts(two)
        assert [e.primitive.name for e in first.eqns] == ["sin"]
        assert first.eqns[0] is old.eqns[0] and first.outvars == old.outvars[:1]


def test_source_info():
    with uses("jax._src.source_info_util.user_frame / user_frames / user_context"):
        closed = jax.make_jaxpr(lambda x: jnp.sin(x))(jnp.ones(3))  # this line
        [eqn] = compat.closed_parts(closed)[0].eqns
        line = inspect.currentframe().f_lineno - 2
        assert compat.user_location(eqn) == f"{__file__}:{line}"
        assert compat.user_frames(eqn)[0] == (__file__, line)
        with compat.equation_context(eqn):
            again = jax.make_jaxpr(lambda x: compat.bind_equation(eqn, [x]))(jnp.ones(3))
        [eqn2] = compat.closed_parts(again)[0].eqns
        assert compat.user_location(eqn2) == f"{__file__}:{line}"


# --------------------------------------------------------------------------- sharding


def _shard_map_eqn(seen: dict):
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:1]), ("x",))

    def body(x):
        seen["varying"] = compat.varying_axes(x)
        return x * 2

    fn = compat.shard_map(
        body, mesh=mesh, in_specs=(P("x"),), out_specs=P("x"), axis_names={"x"}, check_vma=True
    )
    closed = jax.make_jaxpr(fn)(jnp.ones(4))
    return compat.closed_parts(closed)[0].eqns[0]


def test_shard_map_params():
    with uses("shard_map equation params (mesh, in_specs, out_specs, newly_manual_axes, ...)"):
        eqn = _shard_map_eqn({})
        assert compat.is_shard_map(eqn)
        p = compat.shard_map_params(eqn)
        assert p["axis_names"] == frozenset({"x"}) and p["check_vma"] is True
        assert compat.is_body(p["body"]) and len(p["in_specs"]) == 1


def test_varying_manual_axes():
    with uses("ShapedArray.vma (varying manual axes in shard_map bodies)"):
        seen: dict = {}
        _shard_map_eqn(seen)
        assert seen["varying"] == frozenset({"x"})
        assert compat.varying_axes(jnp.ones(2)) == frozenset()


def test_vma_checks():
    with uses("jax._src.config._check_vma"):
        from jax._src import config

        with compat.vma_checks(False):
            assert config._check_vma.value is False
        with compat.vma_checks(True):
            assert config._check_vma.value is True


def test_outside_mesh():
    with uses("jax._src.mesh.empty_abstract_mesh"):
        from jax.sharding import Mesh
        from jax.sharding import PartitionSpec as P

        seen: dict = {}

        def body(x):
            seen["inside"] = compat.context_mesh()
            with compat.outside_mesh():
                seen["outside"] = compat.context_mesh()
            return x

        mesh = Mesh(np.array(jax.devices()[:1]), ("x",))
        fn = compat.shard_map(
            body, mesh=mesh, in_specs=(P("x"),), out_specs=P("x"), axis_names={"x"}, check_vma=True
        )
        jax.make_jaxpr(fn)(jnp.ones(4))
        assert not seen["inside"].empty and seen["outside"].empty


def test_outside_mesh_binds_no_axis_names():
    """Pallas' interpret mode reads every bound axis name: outside the mesh
    none is bound, so a kernel probed there lowers on its own."""
    with uses("jax._src.core.trace_ctx.set_axis_env (bound axis names)"):
        from jax.sharding import Mesh
        from jax.sharding import PartitionSpec as P

        seen: dict = {}

        def body(x):
            seen["inside"] = jax.eval_shape(lambda: jax.lax.axis_index("x")).shape
            with compat.outside_mesh(), pytest.raises(NameError, match="unbound axis name"):
                jax.eval_shape(lambda: jax.lax.axis_index("x"))
            seen["after"] = jax.eval_shape(lambda: jax.lax.axis_index("x")).shape
            return x

        mesh = Mesh(np.array(jax.devices()[:1]), ("x",))
        fn = compat.shard_map(
            body, mesh=mesh, in_specs=(P("x"),), out_specs=P("x"), axis_names={"x"}, check_vma=True
        )
        jax.make_jaxpr(fn)(jnp.ones(4))
        assert seen == {"inside": (), "after": ()}  # bound again after the context


def test_custom_partitioning():
    """One device: the call runs ``fn`` as is (the partitioner is never asked);
    the rule parses, and ``def_partition`` takes both propagations.  The
    8-device behaviour: tests/sharding/multidevice/test_partitioned.py."""
    with uses("jax.experimental.custom_partitioning (def_partition, sharding_rule)"):
        from jax.experimental.custom_partitioning import custom_partitioning

        params = inspect.signature(custom_partitioning.def_partition).parameters
        assert {"infer_sharding_from_operands", "sharding_rule"} <= set(params)

        def never(*args):
            raise AssertionError("partitioned on one device")

        call = compat.partitioned(
            lambda x, y: (x * 2 + y,), partition=never, infer=never, rule="i j, i j -> i j"
        )
        x = jnp.arange(6.0).reshape(2, 3)
        [out] = jax.jit(call)(x, x)
        np.testing.assert_allclose(out, 3 * x)
        assert "custom_partitioning" in str(jax.make_jaxpr(call)(x, x))
        assert isinstance(compat.shardy_enabled(), bool)


# --------------------------------------------------------------------------- argument types


def test_struct_aval():
    with uses("jax._src.core.shaped_abstractify"):
        struct = jax.ShapeDtypeStruct((2, 3), jnp.bfloat16)
        aval = compat.struct_aval(struct)
        traced = compat.closed_parts(jax.make_jaxpr(lambda x: x)(struct))[0].invars[0].aval
        assert aval == traced, (aval, traced)


# --------------------------------------------------------------------------- Pallas


def test_pallas_tpu_flash_attention_module():
    with uses("jax.experimental.pallas.ops.tpu.flash_attention"):
        fa = compat.tpu_flash_attention_module()
        for name in ("flash_attention", "BlockSizes", "SegmentIds"):
            assert hasattr(fa, name), name


def test_pallas_tpu_interpret_mode():
    """Inside the context a Pallas TPU kernel runs on this host (interpreted)."""
    from jax.experimental import pallas as pl

    def add_one(x_ref, o_ref):
        o_ref[...] = x_ref[...] + 1.0

    x = jnp.arange(8 * 128, dtype=jnp.float32).reshape(8, 128)
    with uses("jax.experimental.pallas.tpu.force_tpu_interpret_mode"), compat.tpu_interpret_mode():
        out = pl.pallas_call(add_one, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(x) + 1.0)
    if jax.default_backend() == "cpu":  # outside it, a CPU host cannot run the kernel
        with pytest.raises(Exception):  # noqa: B017 (the error's type varies by version)
            pl.pallas_call(add_one, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x)


def test_splash_attention_module():
    with uses("jax.experimental.pallas.ops.tpu.splash_attention"):
        sa = compat.splash_attention_module()
        for name in ("make_splash_mha", "BlockSizes", "SegmentIds", "FullMask", "CausalMask"):
            assert hasattr(sa, name), name
        mask = sa.MultiHeadMask([sa.CausalMask((128, 128))])
        kernel = compat.make_splash_kernel(mask, head_shards=1, q_seq_shards=1)
        assert kernel.fwd_mask_info.is_dynamic_mask is False


def test_triton_attention_is_used_only_where_jax_keeps_it():
    """`compat.TRITON_ATTENTION` is off exactly where importing the module
    warns (or it is gone); there, flashpass refuses to import it."""
    import sys
    import warnings

    name = "jax.experimental.pallas.ops.gpu.attention"
    saved = sys.modules.pop(name, None)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                importlib.import_module(name)
            except ImportError:  # removed by a later JAX
                assert not compat.TRITON_ATTENTION
    finally:
        sys.modules.pop(name, None)
        if saved is not None:
            sys.modules[name] = saved
    deprecated = [w for w in caught if issubclass(w.category, DeprecationWarning)]
    assert bool(deprecated) == (not compat.TRITON_ATTENTION), [str(w.message) for w in caught]
    if not compat.TRITON_ATTENTION:
        with pytest.raises(RuntimeError, match="deprecates"):
            compat.gpu_attention_module()


@requires_triton
def test_pallas_gpu_attention_module():
    with uses("jax.experimental.pallas.ops.gpu.attention"):
        ga = compat.gpu_attention_module()
        assert callable(ga.mha)
        fields = set(inspect.signature(ga.BlockSizes).parameters)
        assert {"block_q", "block_k", "block_q_dkv", "block_kv_dkv"} <= fields, fields


@requires_triton
def test_pallas_triton_lowers_without_a_gpu():
    """`lower_for_gpu`: JAX >= 0.11 asks the (abstract) device for its compute
    capability when lowering Pallas Triton kernels."""
    shape = jax.ShapeDtypeStruct((1, 128, 1, 64), jnp.float16)  # [B, T, H, D]

    def fn(q, k, v):
        return compat.gpu_attention_module().mha(q, k, v, None)

    with uses("Pallas Triton lowering for cuda (jax.sharding.AbstractDevice)"):
        text = compat.lower_for_gpu(fn, shape, shape, shape)
        assert "__gpu$xla.gpu.triton" in text


# --------------------------------------------------------------------------- lowering, cuDNN


def test_mlir_context():
    with uses("jax._src.interpreters.mlir.make_ir_context / jaxlib.mlir.ir"):
        lowered = jax.jit(lambda x: jnp.sin(x)).lower(jnp.ones(3))
        module = compat.parse_stablehlo(lowered.as_text())
        ops = compat.stablehlo_ops(module)
        assert any(name == "stablehlo.sine" for name, _, _ in ops), ops


def test_cudnn_version_hook():
    with uses("jax._src.cudnn.fused_attention_stablehlo.check_cudnn_version"):
        module = compat._cudnn_attention_module()
        assert callable(module.check_cudnn_version)
        with compat.assume_cudnn(91000):
            assert module.check_cudnn_version() == 91000
            assert compat.cudnn_version() == 91000


def test_cuda_versions():
    with uses("jax._src.lib.cuda_versions"):
        importlib.import_module("jax._src.lib").cuda_versions  # noqa: B018 - None without CUDA
        version = compat.cudnn_version()
        assert version is None or version > 0


def test_nnx_graph_state():
    """Flax NNX's split/merge/state/update, as flashpass/nnx_state.py uses them."""
    nnx = pytest.importorskip("flax.nnx")
    with uses("flax.nnx split/merge/state/update and graph.is_graph_node"):
        model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
        assert compat.is_graph_node(model) and not compat.is_graph_node(jnp.ones(2))
        assert compat.is_graph_object(model) and not compat.is_graph_object(model.bias)
        assert not compat.is_graph_object(nnx.state(model))
        graphdef, state = compat.split_nodes((model,))
        (fresh,) = compat.merge_nodes(graphdef, state)
        assert fresh is not model
        fresh.bias[...] = jnp.ones(3)
        compat.update_nodes((model,), compat.node_state((fresh,)))
        np.testing.assert_array_equal(np.asarray(model.bias[...]), np.ones(3))
        assert hash(graphdef) == hash(compat.split_nodes((model,))[0])


def test_trace_as_names_the_function():
    """jax._src.api_util.debug_info / save_wrapped_fun_debug_info: a wrapper
    over flat leaves traces under the user's function's name and argument paths."""

    def user(x, y):
        return x + float(y["b"])  # concretization error on y['b']

    def flat(*leaves):
        return user(leaves[0], {"b": leaves[1]})

    with uses("jax._src.api_util.debug_info / save_wrapped_fun_debug_info"):
        compat.trace_as(flat, user, (1.0, {"b": 2.0}), {}, (), (), 2)
    with pytest.raises(Exception) as info:
        jax.make_jaxpr(flat)(1.0, 2.0)
    assert "user at" in str(info.value) and "y['b']" in str(info.value), str(info.value)


def test_platform_guard():
    """jax.extend.core.Primitive with mlir.register_lowering(platform=...),
    ad.primitive_jvps and batching.primitive_batchers: the guard is the
    identity where it may run and raises the caller's error where it may not."""

    class Refused(Exception):
        pass

    def refused(platform):
        return Refused(platform)

    host = {"cuda": "gpu", "rocm": "gpu"}.get(jax.default_backend(), jax.default_backend())
    x = jnp.arange(3.0)
    with uses("jax.extend.core.Primitive / jax.interpreters.mlir, ad, batching"):
        ok = jax.jit(lambda x: compat.platform_guard(x, (host,), refused) * 2)
        np.testing.assert_array_equal(np.asarray(ok(x)), np.arange(3.0) * 2)
        grad = jax.grad(lambda x: compat.platform_guard(x, (host,), refused).sum())(x)
        np.testing.assert_array_equal(np.asarray(grad), np.ones(3))
        batched = jax.vmap(lambda x: compat.platform_guard(x, (host,), refused))(x[:, None])
        assert batched.shape == (3, 1)
    elsewhere = tuple(p for p in ("cpu", "gpu", "tpu") if p != host)
    with pytest.raises(Refused, match=host):
        jax.jit(lambda x: compat.platform_guard(x, elsewhere, refused))(x)


# --------------------------------------------------------------------------- StableHLO, Exported


def _small_export():
    return jax.export.export(jax.jit(lambda x, y: jnp.sin(x) @ y))(
        jax.ShapeDtypeStruct((2, 3), jnp.float32), jax.ShapeDtypeStruct((3, 4), jnp.float32)
    )


def test_export_mlir_context_and_parsing():
    exp = _small_export()
    with uses("jax._src.interpreters.mlir.make_ir_context / jax.extend.mlir"):
        context = compat.mlir_context()
        from_text = compat.parse_module(exp.mlir_module(), context)
        from_artifact = compat.parse_module(exp.mlir_module_serialized, context)
        from_bytecode = compat.parse_module(compat.module_bytecode(from_text), context)
        for module in (from_text, from_artifact, from_bytecode):
            assert "stablehlo.dot_general" in str(module)


def test_export_dialect_bindings():
    exp = _small_export()
    with uses("jax.extend.mlir.dialects.stablehlo / jaxlib.mlir.dialects.func"):
        ir, sh = compat.ir_module(), compat.stablehlo_dialect()
        module = compat.parse_module(exp.mlir_module(), compat.mlir_context())
        main = next(iter(module.body.operations))
        dot = next(op for op in main.regions[0].blocks[0] if op.name == "stablehlo.dot_general")
        numbers = sh.DotDimensionNumbers(dot.attributes["dot_dimension_numbers"])
        assert list(numbers.lhs_contracting_dimensions) == [1]
        assert isinstance(ir.RankedTensorType(dot.results[0].type).shape, list)
        assert compat.func_dialect().ReturnOp is not None


def test_export_module_to_artifact():
    exp = _small_export()
    with uses("jax._src.export._export._module_to_bytecode"):
        module = compat.parse_module(exp.mlir_module(), compat.mlir_context())
        data = compat.module_to_artifact(module)
        assert data.startswith(b"ML\xefR")
        assert "stablehlo.sine" in str(compat.parse_module(data, compat.mlir_context()))


def test_exported_from_module_and_vjp():
    exp = _small_export()
    with uses("dataclasses.replace on jax.export.Exported (its private fields)"):
        built = compat.exported_from_module(
            exp.mlir_module_serialized,
            fun_name="built",
            in_avals=exp.in_avals,
            out_avals=exp.out_avals,
            platforms=exp.platforms,
        )
        x, y = jnp.ones((2, 3)), jnp.ones((3, 4))
        np.testing.assert_allclose(built.call(x, y), exp.call(x, y))
        assert not built.has_vjp()
        paired = compat.exported_with_vjp(built, lambda e: _small_export())
        assert paired.has_vjp() and paired.vjp().fun_name == exp.fun_name
        round_trip = jax.export.deserialize(built.serialize())
        np.testing.assert_allclose(round_trip.call(x, y), exp.call(x, y))


def test_exported_with_module():
    exp = _small_export()
    other = jax.export.export(jax.jit(lambda x, y: jnp.cos(x) @ y))(*exp.in_avals)
    with uses("dataclasses.replace on jax.export.Exported (its private fields)"):
        new = compat.exported_with_module(exp, other.mlir_module_serialized)
        assert new.in_avals == exp.in_avals and not new.has_vjp()
        x, y = jnp.ones((2, 3)), jnp.ones((3, 4))
        np.testing.assert_allclose(new.call(x, y), jnp.cos(x) @ y, rtol=1e-6)


def test_exported_shardings():
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((1,), ("x",), (AxisType.Auto,), devices=jax.devices()[:1])
    sharding = NamedSharding(mesh, P("x"))
    struct = jax.ShapeDtypeStruct((2, 3), jnp.float32, sharding=sharding)
    exp = jax.export.export(jax.jit(jnp.sin, out_shardings=sharding))(struct)
    with uses("jax.export.Exported._in_named_shardings / NamedSharding._to_xla_hlo_sharding"):
        named_in, named_out = compat.exported_named_shardings(exp)
        assert named_in[0].spec == P("x") and named_out[0].spec == P("x")
        round_trip = jax.export.deserialize(exp.serialize())
        hlo = compat.exported_hlo_shardings(round_trip)
        assert hlo[0][0] == sharding._to_xla_hlo_sharding(2)
        if round_trip.in_shardings_hlo[0] is not None:  # JAX 0.10 fills them, 0.12 does not
            assert hlo == (round_trip.in_shardings_hlo, round_trip.out_shardings_hlo)
        assert compat.exported_hlo_shardings(exp) == hlo


def test_x64_scope():
    with uses("jax.enable_x64 (a context manager) / jax.config.jax_enable_x64"):
        outside = compat.x64_enabled()
        with compat.x64_scope(True):
            assert compat.x64_enabled()
            assert jnp.zeros(2, jnp.int64).dtype == jnp.int64
            with compat.x64_scope(False):
                assert not compat.x64_enabled()
        assert compat.x64_enabled() == outside


# --------------------------------------------------------------------------- more entry points


def _in_shard_map(body):
    """``body(x)`` traced inside a one-device ``shard_map`` over axis "x"."""
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:1]), ("x",))
    fn = compat.shard_map(
        body, mesh=mesh, in_specs=(P("x"),), out_specs=P("x"), axis_names={"x"}, check_vma=True
    )
    return jax.make_jaxpr(fn)(jnp.ones(4))


def test_vary_like_and_vary_over():
    with uses("jax.lax.pcast(..., to='varying') (varying manual axes)"):
        seen: dict = {}

        def body(x):
            zero = jnp.zeros(4)
            seen["before"] = compat.varying_axes(zero)
            seen["over"] = compat.varying_axes(compat.vary_over(zero, frozenset({"x"})))
            seen["like"] = compat.varying_axes(compat.vary_like(zero, x))
            return x + compat.vary_like(zero, x)

        _in_shard_map(body)
        assert seen == {"before": frozenset(), "over": {"x"}, "like": {"x"}}
        assert compat.vary_over(jnp.ones(2), frozenset()).shape == (2,)  # nothing to add


def test_without_varying_and_aval_key():
    with uses("ShapedArray.vma / .mat (varying manual axes of a type)"):
        seen: dict = {}

        def body(x):
            seen["aval"] = jax.typeof(x)
            return x

        _in_shard_map(body)
        varying = seen["aval"]
        plain = compat.without_varying(varying)
        assert plain.shape == varying.shape and plain.dtype == varying.dtype
        assert compat.aval_key(plain) != compat.aval_key(varying)  # str() alone is equal
        assert compat.aval_key(compat.without_varying(plain)) == compat.aval_key(plain)


def test_axis_env_and_only_axis_effects():
    with uses("jax._src.core.extend_axis_env_nd / NamedAxisEffect"):
        with compat.axis_env({"i": 4}):
            closed = jax.make_jaxpr(lambda x: jax.lax.all_gather(x, "i", tiled=True))(jnp.ones(2))
        [eqn] = compat.closed_parts(closed)[0].eqns
        assert eqn.outvars[0].aval.shape == (8,)
        assert compat.only_axis_effects(eqn.effects) and compat.only_axis_effects(set())
        printing = jax.make_jaxpr(lambda x: jax.debug.print("{}", x))(1.0)
        effects = compat.closed_parts(printing)[0].eqns[0].effects
        assert effects and not compat.only_axis_effects(effects)


def test_is_tracer():
    with uses("jax.core.Tracer"):
        seen = []
        jax.make_jaxpr(lambda x: seen.append(compat.is_tracer(x)) or x)(1.0)
        assert seen == [True] and not compat.is_tracer(jnp.ones(2))


def test_threefry2x32():
    with uses("jax.extend.random.threefry2x32_p"):
        # Threefry-2x32 (20 rounds), the known-answer test of the Random123 suite.
        hi, lo = compat.threefry2x32(
            np.uint32(0x13198A2E), np.uint32(0x03707344),
            jnp.uint32(0x243F6A88), jnp.uint32(0x85A308D3),
        )  # fmt: skip
        assert (int(hi), int(lo)) == (0xC4923A9C, 0x483DF7A0)


def test_key_internals():
    with uses("PRNG key dtypes (._impl.name) and random_wrap params"):
        key = jax.random.key(3)
        assert compat.is_key_dtype(key.dtype) and not compat.is_key_dtype(jnp.uint32)
        assert compat.prng_impl_name(key.dtype) == "threefry2x32"
        np.testing.assert_array_equal(compat.raw_key_data(key), jax.random.key_data(key))
        raw = jnp.array([0, 3], jnp.uint32)
        np.testing.assert_array_equal(compat.raw_key_data(raw), raw)
        closed = jax.make_jaxpr(jax.random.wrap_key_data)(raw)
        [eqn] = compat.closed_parts(closed)[0].eqns
        assert compat.wrap_impl_name(eqn.params) == "threefry2x32"
        assert compat.threefry_partitionable() is bool(jax.config.jax_threefry_partitionable)


def test_traced_with_enters_the_context_in_every_rule():
    entered = []

    @contextlib.contextmanager
    def context():
        entered.append(True)
        yield

    fn = compat.traced_with(jnp.sin, context)
    value, grad = jax.value_and_grad(fn)(0.5)
    assert np.isclose(value, np.sin(0.5)) and np.isclose(grad, np.cos(0.5))
    assert len(entered) == 2  # the forward rule and the backward rule
    jax.jit(fn)(0.5)
    assert len(entered) == 3  # the primal
    tpu = compat.pallas_tpu_traced(jnp.sin, interpret=False)
    assert np.isclose(jax.grad(tpu)(0.5), np.cos(0.5))


def test_tpu_paged_attention_module():
    with uses("jax.experimental.pallas.ops.tpu.paged_attention"):
        module = compat.tpu_paged_attention_module()
        params = inspect.signature(module.paged_attention).parameters
        assert {"q", "k_pages", "v_pages", "lengths", "page_indices"} <= set(params), params


def test_splash_private_entry_points():
    with uses("splash_attention_kernel._splash_attention_bwd / ChunkedCausalMask"):
        from jax.experimental.pallas.ops.tpu.splash_attention import (
            splash_attention_kernel as sk,
        )

        names = list(inspect.signature(sk._splash_attention_bwd).parameters)
        assert names == [
            "save_residuals",
            "mask_value",
            "is_mqa",
            "block_sizes",
            "residual_checkpoint_name",
            "mask_function",
            "attn_logits_soft_cap",
            "interpret",
            "res",
            "do",
        ]  # fmt: skip  (the order `compat.splash_backward` passes them in)
        mask = compat.splash_chunked_causal_mask((8, 8), 4)
        dense = np.asarray(mask[:, :])
        assert dense[5, 4] and not dense[5, 3] and not dense[4, 5]


@requires_triton
def test_pallas_gpu_private_entry_points():
    with uses("pallas gpu attention mha(return_residuals=...) / _mha_backward"):
        module = compat.gpu_attention_module()
        assert "return_residuals" in inspect.signature(module.mha).parameters
        names = list(inspect.signature(module._mha_backward).parameters)
        assert names == [
            "sm_scale",
            "causal",
            "block_sizes",
            "backward_pass_impl",
            "num_warps",
            "num_stages",
            "grid",
            "interpret",
            "debug",
            "return_residuals",
            "res",
            "do",
        ]  # fmt: skip  (the order `compat.gpu_attention_backward` passes them in)


def test_tokamax_module():
    module = compat.tokamax_module()
    assert (module is not None) == compat.tokamax_installed()
    if module is None:
        return
    assert hasattr(module, "dot_product_attention")
    from absl import flags

    # Else tokamax parses sys.argv (pytest's arguments) at its first call and raises.
    assert flags.FLAGS.is_parsed()
    assert flags.FLAGS.tokamax_autotuning_cache_miss_fallback == "heuristics"


# --------------------------------------------------------------------------- experimental modules


def _experimental_imports() -> set[str]:
    """The ``jax.experimental`` modules flashpass's source imports (parsed, not run)."""
    import ast
    import pathlib

    root = pathlib.Path(compat.__file__).resolve().parents[2]
    found = set()
    for package in ("flashpass", "kernels", "patterns"):
        for path in (root / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    found.update(a.name for a in node.names)
                elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    # Every ``from jax.experimental... import x`` here imports a module.
                    found.update(f"{node.module}.{a.name}" for a in node.names)
    return {name for name in found if name.startswith("jax.experimental")}


def test_experimental_modules_are_listed_and_exist():
    """`compat.EXPERIMENTAL_MODULES` lists exactly the experimental modules
    imported, and each imports on the installed JAX (inside its known range)."""
    from flashpass.compat._kernels import EXPERIMENTAL_MODULES

    assert _experimental_imports() == set(EXPERIMENTAL_MODULES)
    for name, (first, last) in EXPERIMENTAL_MODULES.items():
        assert compat.JAX_VERSION >= _version(first), (name, first)
        if compat.JAX_VERSION <= _version(last):
            with uses(name):
                importlib.import_module(name)


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split("."))


def test_dce_loop_bodies():
    with uses("jax._src.interpreters.partial_eval.dce_jaxpr"):

        def body(carry):
            i, x = carry
            jnp.cos(x)  # dead: JAX's own DCE (up to 0.10) keeps a while loop whole
            return i + 1, jnp.sin(x)

        def f(x):
            y = jax.jit(lambda x: jax.lax.while_loop(lambda c: c[0] < 2, body, (0, x)))(x)
            return y[1]

        closed = jax.make_jaxpr(f)(jnp.ones(3))
        new = compat.dce_closed_jaxpr(compat.dce_loop_bodies(closed))
        text = str(new)
        assert "cos" not in text and "sin" in text and "while" in text
        # (JAX up to 0.10 keeps the body whole, the reason for dce_loop_bodies;
        # JAX 0.12 prunes a while body itself: either way the result above holds.)
        jaxpr, consts = compat.closed_parts(new)
        out = compat.eval_jaxpr(jaxpr, consts, jnp.ones(3))[0]
        np.testing.assert_allclose(out, f(jnp.ones(3)), rtol=1e-6)
        # Nothing to clean: the same object back.
        plain = jax.make_jaxpr(jnp.sin)(jnp.ones(3))
        assert compat.dce_loop_bodies(plain) is plain


def test_same_layout():
    # A reshard is a copy on the score chain only when it moves nothing.
    from types import SimpleNamespace as NS

    from jax.sharding import PartitionSpec as P

    mesh = NS(empty=False, size=2)
    sharded = NS(sharding=NS(mesh=mesh, spec=P("x")))
    assert compat.same_layout(NS(sharding=None), NS(sharding=None))
    assert compat.same_layout(sharded, NS(sharding=NS(mesh=mesh, spec=P("x"))))
    assert not compat.same_layout(sharded, NS(sharding=NS(mesh=mesh, spec=P(None, "x"))))
    assert not compat.same_layout(sharded, NS(sharding=None))


def test_compilation_cache(tmp_path, monkeypatch):
    """The test suite's persistent compilation cache (tests/conftest.py): its
    options exist, a compile writes an entry, and a second process compiling
    the same program (where the entry is there to read) computes the same
    (in subprocesses: a process's first compilation decides whether it uses a
    cache at all)."""
    import subprocess
    import sys

    with uses("jax.config's persistent compilation cache options"):
        for name in ("CACHE_DIR", "MIN_COMPILE_TIME", "MIN_ENTRY_SIZE"):
            assert hasattr(jax.config, getattr(compat._cache, name))
    assert compat.compilation_cache_dir() == (os.environ.get("JAX_COMPILATION_CACHE_DIR") or None)
    assert compat.compilation_cache("") is False
    program = (
        "import sys, jax, jax.numpy as jnp; from flashpass import compat; "
        "assert compat.compilation_cache(sys.argv[1]); "
        "assert compat.compilation_cache_dir() == sys.argv[1]; "
        "print(jax.jit(lambda x: jnp.sin(x) @ x.T)(jnp.ones((8, 8))).sum())"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    outs = []
    for _ in range(2):
        proc = subprocess.run(
            [sys.executable, "-c", program, str(tmp_path)], env=env, capture_output=True, text=True
        )
        assert proc.returncode == 0, proc.stderr
        outs.append(proc.stdout)
        entries = sorted(p.name for p in tmp_path.iterdir())
        assert any("jit__lambda" in name for name in entries), entries
    assert outs[0] == outs[1]
