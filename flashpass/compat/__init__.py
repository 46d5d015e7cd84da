"""Every JAX-version difference and every private or experimental JAX import.

flashpass touches JAX internals (jaxpr data structures, source info, DCE) and
experimental modules (Pallas kernels).  They all go through this package,
``flashpass.compat`` (jaxprs in _jaxpr.py, StableHLO modules and `Exported` in
_export.py, kernels in _kernels.py, sharding in _sharding.py, the persistent
compilation cache the tests share in _cache.py, placement by XLA's partitioner
(``custom_partitioning``) in _partitioning.py, the PRNG internals
of exact dropout in _random.py; the rest of flashpass imports only from here), so
a JAX upgrade that moves something breaks here, loudly, and nowhere else.

Supported: JAX 0.9.x to 0.12.x (CI runs the version in constraints.txt, the
oldest, 0.9.0, and the newest, 0.12.0.1).  tests/test_compat.py has one test
per private or experimental API used here: when a JAX release moves one, that
test names it and the installed version.
"""

from __future__ import annotations

from ._cache import compilation_cache, compilation_cache_dir  # noqa: F401
from ._debug import name_stack, trace_as  # noqa: F401
from ._export import (  # noqa: F401
    exported_from_module,
    exported_hlo_shardings,
    exported_named_shardings,
    exported_with_module,
    exported_with_vjp,
    func_dialect,
    ir_element_type,
    ir_module,
    mlir_context,
    module_bytecode,
    module_to_artifact,
    parse_module,
    stablehlo_dialect,
    x64_enabled,
    x64_scope,
)
from ._guard import platform_guard  # noqa: F401
from ._jaxpr import (  # noqa: F401
    _BODY_TYPES,
    _CAN_EMIT,
    _CAN_EMIT_LITERALS,
    _CLOSED_BODY_PARAMS,
    JAX_VERSION,
    UNIFIED_JAXPR,
    DropVar,
    JaxprEqn,
    Literal,
    Primitive,
    ShapedArray,
    Var,
    _ClosedJaxpr,
    _emit_signature_ok,
    _emit_unchanged,
    _eval_jaxpr,
    as_closed,
    bind_equation,
    bind_view_identity,
    bodies_in_params,
    closed_jaxpr,
    closed_parts,
    compile_time_eval,
    dce_closed_jaxpr,
    dce_loop_bodies,
    eval_jaxpr,
    evaluate_equation,
    get_aval,
    is_body,
    is_drop_var,
    is_literal,
    is_noop_rounding,
    is_tracer,
    is_view_identity,
    jaxpr_as_fun,
    literal_value,
    passthrough_operands,
    rebuild_body,
    replace_bodies,
    scan_counts,
    sliced_operands,
    struct_aval,
    subjaxprs_of_params,
    threads_operands,
    user_frames,
    user_location,
    with_leading_operands,
)
from ._kernels import (  # noqa: F401
    _ASSUMED_CUDNN,
    ASSUMED_GPU_KIND,
    TRITON_ATTENTION,
    _abstract_gpu,
    _cudnn_attention_module,
    assume_cudnn,
    cudnn_version,
    gpu_attention_backward,
    gpu_attention_module,
    gpu_attention_with_lse,
    gpu_compute_capability,
    is_forward_mode_error,
    lower_for_gpu,
    lower_for_tpu,
    make_splash_kernel,
    pallas_tpu_context,
    pallas_tpu_modules,
    pallas_tpu_traced,
    pallas_triton_modules,
    parse_stablehlo,
    splash_attention_module,
    splash_backward,
    splash_chunked_causal_mask,
    stablehlo_ops,
    tokamax_installed,
    tokamax_module,
    tpu_flash_attention_module,
    tpu_interpret_mode,
    tpu_paged_attention_module,
    traced_with,
)
from ._nnx import (  # noqa: F401
    is_graph_node,
    is_graph_object,
    merge_nodes,
    nnx_loaded,
    node_state,
    split_nodes,
    update_nodes,
)
from ._partitioning import partitioned, shardy_enabled  # noqa: F401
from ._random import (  # noqa: F401
    is_key_dtype,
    prng_impl_name,
    raw_key_data,
    threefry2x32,
    threefry2x32_rounds,
    threefry_partitionable,
    wrap_impl_name,
)
from ._sharding import (  # noqa: F401
    VALUE_IDENTITY_PRIMITIVES,
    aval_key,
    axis_env,
    axis_kinds,
    context_mesh,
    equation_context,
    is_shard_map,
    named_sharding_of,
    only_axis_effects,
    outside_mesh,
    reshard,
    same_layout,
    shard_map,
    shard_map_params,
    vary_like,
    vary_over,
    varying_axes,
    vma_checks,
    without_varying,
)
