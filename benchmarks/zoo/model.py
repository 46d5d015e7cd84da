"""What a zoo suite hands the harness: one `ZooModel` per architecture.

A suite module (``benchmarks/zoo/suites/<suite>.py``) defines ``MODELS``, a list of
`ZooModel`.  Building is lazy (``build()`` imports the library), so listing a
suite costs nothing and a library that is not installed marks its models
unavailable instead of failing the sweep.

``build()`` returns a `Built`: plain JAX functions over a params pytree and
inputs, with random weights from a tiny config (no downloads, no checkpoints).
Every mode the harness runs derives from these functions:

* ``forward(params, *inputs)`` -> array or pytree of arrays (direct and under
  ``jax.jit``);
* ``loss(params, *inputs)`` -> scalar, for the training step (``value_and_grad``
  plus an optax or library update);
* ``generate(params, *inputs)`` -> token ids, greedy decoding with a KV cache
  (causal LMs whose library has one); ``None`` where there is none;
* ``export``: whether the forward is also swept as a ``jax.export`` artifact
  through ``flashpass.export`` (both routes).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any


@dataclasses.dataclass
class Built:
    """A built tiny model: functions of ``(params, *inputs)`` and their arguments."""

    forward: Callable[..., Any]
    params: Any
    inputs: tuple
    loss: Callable[..., Any] | None = None
    generate: Callable[..., Any] | None = None
    generate_inputs: tuple | None = None  # defaults to ``inputs``
    export: bool = True
    #: Query and key lengths of the attention sites (for the T x S checks);
    #: ``None``: read from the inputs' sequence axis by the harness.
    seq: tuple[int, int] | None = None
    #: Anything the record should say about how it was built (sizes, options).
    notes: str = ""


@dataclasses.dataclass(frozen=True)
class ZooModel:
    """One architecture of a suite."""

    suite: str  # hf_flax | hf_torch | timm | keras_hub | jax_native
    name: str  # unique within the suite, e.g. "FlaxGPT2LMHeadModel"
    family: str  # e.g. "decoder", "encoder", "encoder-decoder", "vision", "speech"
    build: Callable[[], Built]
    #: Modes this model is swept in; the harness skips others with the reason.
    modes: tuple[str, ...] = ("direct", "jit", "train", "generate", "export")
    #: Whether the CI sample includes it (at least one model per family per suite).
    sample: bool = False
    #: The kernel the pass is forced to (``"blockwise"``: the CPU cost model
    #: keeps no short site); ``None``: the platform's default kernel order
    #: (the long-sequence entries that exercise the defaults).
    kernel: str | None = "blockwise"
