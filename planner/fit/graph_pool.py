"""The graph pool an engine's capture leaves: its forward at every capture size, captured in
the engine's order into one private pool of PyTorch's caching allocator, as the planner
simulates one (planner/memory/analytic.py's programs, planner/memory/allocator.py's pool).

Why a simulation and not the largest size's bytes: the pool is made of the allocator's
segments, not of tensors. At decode sizes a layer's tensors are a few MiB each, and the
allocator serves them from 2 MiB segments (requests up to 1 MiB) and 20 MiB ones (under
10 MiB), so the pool holds more than its tensors add up to: the simulated pool of the fit
bench's 8-layer Llama at 256 requests is about twice its largest size's tensors, and the
runners' measured pools agree with the simulation (bench/fit_bench.py, docs/fit.md).

Engine-neutral: the engines' layers say what their graphs hold after the forward
(:class:`Graph`'s ``logits`` and ``pieces``), and what their attention kernels add beside it (vLLM's FA3
split-KV accumulators, planner/fit/vllm.py).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

from capture_plan.planner.inputs.resources import backend
from capture_plan.planner.memory.allocator import PoolSim
from capture_plan.planner.memory.analytic import forward_program
from capture_plan.schemas.spec import Model

from .model import FitModel
from .tables import estimates

__all__ = ["Graph", "Captures", "pool_bytes", "padded_vocab"]


class Graph(NamedTuple):
    """One graph an engine captures into its pool: its forward over ``tokens`` (one per
    request); ``extra``: bytes each of its attention calls allocates besides the backend's own
    (vLLM's FA3 split-KV accumulators in its FULL graphs); ``pieces``: it is pieces between
    attention calls run eagerly (vLLM's PIECEWISE graphs, SGLang's breakable prefill graphs);
    ``logits``: it computes the model-dtype logits over the padded vocabulary after the final
    norm (SGLang 0.5.23's decode graphs, which copy them into the engine's own float32 buffer
    outside the pool), else it ends at the final norm."""

    tokens: int
    extra: int = 0
    pieces: bool = False
    logits: bool = False


class Captures(NamedTuple):
    """What an engine captures into its pool, in its order; ``extra_source``: what the graphs'
    ``extra`` bytes are ("" where none)."""

    graphs: list[Graph]
    extra_source: str = ""


def padded_vocab(m: FitModel) -> int:
    """The LM head's rows: the vocabulary padded as both engines' ParallelLMHead pads it
    (vLLM and SGLang ``pad_vocab_size``, ``DEFAULT_VOCAB_PADDING_SIZE`` 64)."""
    pad = estimates()["graph"]["vocab_padding"]
    return -(-m.vocab // pad) * pad


def _spec_model(m: FitModel) -> Model:
    """The planner's model of ``m``'s dense decoder (the analytic programs model no MoE
    routing: an MoE model's layer is priced as its dense MLP, as planner/memory/analytic.py
    says)."""
    return Model(
        name=m.name,
        layers=m.layers,
        hidden=m.hidden,
        heads=m.heads,
        kv_heads=m.kv_heads,
        head_dim=m.head_dim,
        intermediate=m.intermediate or m.expert_intermediate,
        vocab=padded_vocab(m),
        dtype_bytes=m.dtype_bytes,
    )


def pool_bytes(m: FitModel, tp: int, sm: str, captures: Captures) -> tuple[int, str]:
    """The bytes of the segments of one private pool after ``captures`` in their order, each
    graph's blocks freed at its end, and what they are. The attention backend is the one
    fit_estimates.toml [graph.pool_backend] names for ``sm`` (the engines' default there),
    else one with no per-call buffers."""
    if not captures.graphs:
        return 0, "no graphs"
    e = estimates()["graph"]
    name = e["pool_backend"].get(sm, e["pool_backend"]["default"])
    reserved = _simulated(_spec_model(m), name, tp, tuple(captures.graphs))
    kinds = []
    if pieced := sum(g.pieces for g in captures.graphs):
        kinds.append(f"{pieced} in pieces (attention run between them)")
    if logits := sum(g.logits for g in captures.graphs):
        kinds.append(f"{logits} with the model-dtype logits (padded vocabulary) after the final norm")
    what = f"; of them {', '.join(kinds)}" if kinds else ""
    extra = f"; {captures.extra_source}, allocated at each attention call" if captures.extra_source else ""
    return reserved, (
        f"the pool simulated: {len(captures.graphs)} graphs captured in the engine's order into one private "
        f"pool of PyTorch's caching allocator (planner/memory/allocator.py, its 2 MiB and 20 MiB segments), "
        f"each the forward's layers and final norm (planner/memory/analytic.py forward_program, {name} "
        f"attention){what}{extra}"
    )


@functools.lru_cache(maxsize=64)
def _simulated(model: Model, backend_name: str, tp: int, graphs: tuple[Graph, ...]) -> int:
    """The reserved bytes of one private pool after ``graphs`` in their order. Cached: fit prices
    the same captures again for every fix it checks (a shorter context, fp8 KV) and every size
    list, and an engine's thousands of capture sizes (--max-cudagraph-capture-size 65536) take
    seconds each time."""
    be = backend(backend_name)
    pool = PoolSim()
    for g in graphs:
        prog = forward_program(model, g.tokens, be, tp, logits=g.logits, attention_extra=g.extra, pieces=g.pieces)
        pool.capture(prog, view=True)
    return pool.reserved
