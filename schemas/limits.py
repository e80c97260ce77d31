"""Resource limits: inputs beyond these are refused up front, with a located error.

The planner's work grows with capture sizes, phases and layer bodies; the
limits sit far above any real serving engine (SGLang captures at most a few
hundred sizes in at most four phases) so that every accepted input builds in
bounded time and memory, and absurd numbers (``1e308``, ``10**200``) are
reported instead of overflowing somewhere deep in the simulator.

The bounds of single fields are msgspec constraints on the schema types
(:func:`dimension`, :data:`BatchSize` and the ``Annotated`` fields of
spec.py, plan.py, trace.py, report.py), built from the numbers here: msgspec
locates a violation, ``schemas/conversion.py`` words it, and
``planner schema`` publishes the same bounds as ``minimum``/``maximum``/
``maxItems``. Rules over several fields (sizes unique, ``MAX_CAPTURES`` over
all phases, ``heads`` a multiple of ``kv_heads``) are checked by hand in
``capture_plan.planner.inputs.validate``; the range of every number
(:data:`MAX_INT`, finite) and :data:`MAX_DEPTH` by ``schemas/documents.py``'s walk
over a decoded document.

What these do NOT bound: the run time of a build inside the limits (a spec at
every limit at once is slow, minutes, but finishes), or anything the executor
does on a GPU.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

__all__ = [
    "MAX_BS",
    "MAX_SIZES_PER_PHASE",
    "MAX_CAPTURES",
    "MAX_PHASES",
    "MAX_RULES",
    "MAX_INT",
    "MAX_MIB",
    "MODEL_MAX",
    "MAX_TP",
    "MAX_TOKENS_PER_REQUEST",
    "MAX_CONTEXT",
    "MAX_EVENT_BYTES",
    "FILE_LIMITS",
    "MAX_DEPTH",
    "MAX_VARIANT_AXES",
    "MAX_LABELS_PER_AXIS",
    "MAX_KEYS_PER_PHASE",
    "MAX_PIECES",
    "MAX_MICRO_BATCHES",
    "BatchSize",
    "AxisName",
    "Label",
    "StreamName",
    "NonNegative",
    "ByteDelta",
    "NonNegativeFloat",
    "dimension",
]

#: largest capture size (batch size) of any phase, and of ``--max-bs``
MAX_BS = 65536
#: capture sizes in one phase
MAX_SIZES_PER_PHASE = 4096
#: capture sizes over all phases together (the step graph has ~2 nodes each)
MAX_CAPTURES = 8192
#: phases in one spec (a chain of ``after`` is bounded by this too)
MAX_PHASES = 32
#: rules a spec may add
MAX_RULES = 256
#: tokens per request of a multi-token phase
MAX_TOKENS_PER_REQUEST = 4096
#: tokens of KV cache one request reads (``--context``) where the model's config names no
#: ``max_position_embeddings``: 16M, above every released model's context window (10M)
MAX_CONTEXT = 1 << 24
#: any integer in any input file: 2**53, exact in every JSON reader
MAX_INT = 2**53
#: ``budget_mib`` and ``library_mib``: 2**30 MiB is 1 PiB
MAX_MIB = float(2**30)
#: upper bound of each model dimension (the largest real models are 10-100x below)
MODEL_MAX: dict[str, int] = {
    "layers": 1024,
    "hidden": 1 << 20,
    "heads": 1 << 14,
    "kv_heads": 1 << 14,
    "head_dim": 1 << 14,
    "intermediate": 1 << 22,
    "vocab": 1 << 24,
    "dtype_bytes": 16,
    "logits_dtype_bytes": 16,
}
#: the largest tensor-parallel size (``--tp``): no more ranks than the largest model has heads
MAX_TP = MODEL_MAX["heads"]
#: model dimensions not in MODEL_MAX (fields added later) get this bound
MODEL_MAX_DEFAULT = 1 << 24
#: one allocation of a recorded trace: 1 TiB
MAX_EVENT_BYTES = 1 << 40
#: files larger than this are refused before reading (bytes), per kind
FILE_LIMITS: dict[str, int] = {
    "spec": 4 << 20,
    "plan": 64 << 20,
    "trace": 512 << 20,
    "report": 64 << 20,
    # a start-up calibration (schemas/startup.py): a plan and a few figures
    "calibration": 64 << 20,
    # a Hugging Face config.json a spec names (real ones are a few KiB)
    "config": 4 << 20,
    # the batch sizes an engine ran (`planner sizes --traffic`): a CSV, JSON or a Prometheus scrape
    "traffic": 64 << 20,
    # a graph file (schemas/graph_file.py): every node's argument bytes, hundreds of graphs of ~1,000 nodes
    "graph file": 2 << 30,
}
#: nesting depth of any input document (real ones need 6)
MAX_DEPTH = 64
#: variant axes of one phase (SGLang keys by two: LoRA and attention variant; vLLM's
#: descriptors by a few more: active LoRAs, micro-batches)
MAX_VARIANT_AXES = 8
#: labels of one variant axis
MAX_LABELS_PER_AXIS = 16
#: graph keys of one phase: its sizes times the labels of each axis (a rule over several
#: fields, checked by capture_plan.planner.inputs.validate and published by `planner schema spec`
#: as ``x-max-keys-per-phase``); MAX_CAPTURES bounds the keys of all phases together
MAX_KEYS_PER_PHASE = 8192
#: piece graphs of one piecewise capture (vLLM splits at every attention op: layers + 1)
MAX_PIECES = 1025
#: micro-batches of one graph (vLLM's num_ubatches; 2 with dual-batch overlap)
MAX_MICRO_BATCHES = 8


#: a capture size (batch size): 1..MAX_BS
BatchSize = Annotated[int, msgspec.Meta(ge=1, le=MAX_BS)]
#: a byte count, a count or an index
NonNegative = Annotated[int, msgspec.Meta(ge=0)]
#: a difference of two byte readings (a device-memory item measured as after - before):
#: negative where memory was given back meanwhile; bounded by MAX_INT both ways
ByteDelta = Annotated[int, msgspec.Meta(ge=-MAX_INT, le=MAX_INT)]
#: seconds
NonNegativeFloat = Annotated[float, msgspec.Meta(ge=0)]
# `$(?!\n)`: Python's `$` also matches before a trailing newline; the lookahead refuses that
#: a variant axis's name (``lora``, ``attention``): what step ids and spec keys spell
AxisName = Annotated[str, msgspec.Meta(pattern=r"^[a-z][a-z0-9_]*$(?!\n)", max_length=32)]
#: a label of a variant axis (``lora``, ``nolora``, ``fa3.v2``): no ``/``, ``,`` or ``=``,
#: which step ids use as separators
Label = Annotated[str, msgspec.Meta(pattern=r"^[a-z0-9][a-z0-9_.-]*$(?!\n)", max_length=32)]
#: a stream a step records on: ``capture`` (the capture stream) or another the engine owns
#: (``ubatch``: vLLM's micro-batch twin)
StreamName = Annotated[str, msgspec.Meta(pattern=r"^[a-z][a-z0-9_.-]*$(?!\n)", max_length=64)]


def dimension(field: str) -> msgspec.Meta:
    """The constraint of model dimension ``field``, for ``Annotated[int, dimension(field)]``:
    from 1 to its :data:`MODEL_MAX` bound (:data:`MODEL_MAX_DEFAULT` for a field not
    listed there). The constraint, not the whole ``Annotated`` type: a type checker
    reads ``Annotated[int, ...]`` written out as the type int, a returned type as a
    value it cannot use in an annotation."""
    return msgspec.Meta(ge=1, le=MODEL_MAX.get(field, MODEL_MAX_DEFAULT))
