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
from capture_plan.planner.memory.analytic import eagle_draft_program, forward_program
from capture_plan.schemas.spec import Model

from .model import FitModel
from .tables import estimates

__all__ = ["Graph", "DraftGraph", "DraftCaptures", "Captures", "pool_bytes", "padded_vocab"]


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


class DraftGraph(NamedTuple):
    """One graph of a speculative draft (vLLM's EAGLE speculator): ``steps`` draft steps over
    ``reqs`` requests of ``tokens_per_request`` tokens each (planner/memory/analytic.py
    eagle_draft_program)."""

    reqs: int
    tokens_per_request: int
    steps: int
    #: bytes each of its attention calls allocates besides the backend's own (:class:`Graph`'s)
    extra: int = 0
    #: the draft's forward alone in pieces between its attention calls (a PIECEWISE graph of the
    #: prefill manager: the sampling runs eagerly after it), its ``reqs`` the tokens
    pieces: bool = False


class DraftCaptures(NamedTuple):
    """A speculative draft's graphs: each manager's (``managers``, each in its order) captured
    on a capture stream of its own into the target's pool (vLLM's ``graph_capture`` makes a new
    stream for each manager's capture; the caching allocator hands a stream's freed blocks to
    that stream alone), so no manager reuses what another freed: each is a pool of its own
    segments. ``model``: the draft's layers at the target's padded vocabulary (its lm_head the
    target's); ``argmax_block``: the release's greedy argmax's block (0: torch's argmax)."""

    model: FitModel
    managers: tuple[tuple[DraftGraph, ...], ...]
    argmax_block: int = 0

    @property
    def execs(self) -> int:
        """The graph execs instantiated: one a FULL graph, the layers + 1 pieces of a PIECEWISE one."""
        return sum(self.model.layers + 1 if g.pieces else 1 for manager in self.managers for g in manager)

    @property
    def layer_runs(self) -> int:
        """The draft's layers its graphs run, all graphs together (their graph-exec nodes)."""
        return sum(g.steps * self.model.layers for manager in self.managers for g in manager)

    @property
    def how(self) -> str:
        counts = " + ".join(f"{len(m)} {'PIECEWISE and FULL' if m[0].pieces else 'FULL'}" for m in self.managers)
        return f"the draft's {sum(map(len, self.managers))} graphs ({counts}; {self.execs} graph execs)"


class Captures(NamedTuple):
    """What an engine captures into its pool, in its order; ``extra_source``: what the graphs'
    ``extra`` bytes are ("" where none); ``draft``: a speculative draft's graphs, captured after
    them (None: none)."""

    graphs: list[Graph]
    extra_source: str = ""
    draft: DraftCaptures | None = None

    @property
    def streams(self) -> int:
        """The capture streams the graphs are captured on (each keeps a cuBLAS workspace)."""
        return (1 if self.graphs else 0) + (len(self.draft.managers) if self.draft else 0)


def padded_vocab(m: FitModel) -> int:
    """The LM head's rows: the vocabulary padded as both engines' ParallelLMHead pads it
    (vLLM and SGLang ``pad_vocab_size``, ``DEFAULT_VOCAB_PADDING_SIZE`` 64)."""
    pad = estimates()["graph"]["vocab_padding"]
    return -(-m.vocab // pad) * pad


def _spec_model(m: FitModel, vocab: int | None = None) -> Model:
    """The planner's model of ``m``'s dense decoder (the analytic programs model no MoE
    routing: an MoE model's layer is priced as its dense MLP, as planner/memory/analytic.py
    says); ``vocab``: its head's rows where not its own padded vocabulary (a draft's head the
    target's)."""
    return Model(
        name=m.name,
        layers=m.layers,
        hidden=m.hidden,
        heads=m.heads,
        kv_heads=m.kv_heads,
        head_dim=m.head_dim,
        intermediate=m.intermediate or m.expert_intermediate,
        vocab=vocab or padded_vocab(m),
        dtype_bytes=m.dtype_bytes,
    )


def pool_bytes(m: FitModel, tp: int, sm: str, captures: Captures) -> tuple[int, str]:
    """The bytes of the segments of one private pool after ``captures`` in their order, each
    graph's blocks freed at its end, and what they are. The attention backend is the one
    fit_estimates.toml [graph.pool_backend] names for ``sm`` (the engines' default there),
    else one with no per-call buffers."""
    if not captures.graphs and captures.draft is None:
        return 0, "no graphs"
    e = estimates()["graph"]
    name = e["pool_backend"].get(sm, e["pool_backend"]["default"])
    reserved = _simulated(_spec_model(m), name, tp, tuple(captures.graphs)) if captures.graphs else 0
    drafted = ""
    if (dr := captures.draft) is not None:
        head = _spec_model(dr.model, padded_vocab(m))
        reserved += sum(_drafted(head, name, tp, manager, dr.argmax_block) for manager in dr.managers)
        argmax = f"greedy_argmax's partials in {dr.argmax_block}-wide blocks" if dr.argmax_block else "torch's argmax"
        drafted = (
            "; then the draft's graphs, its managers on capture streams of their own, so each a pool of its own "
            "segments: planner/memory/analytic.py eagle_draft_program: its forward, the model-dtype logits of "
            f"each request's last token and {argmax}; a PIECEWISE one its forward alone, forward_program)"
        )
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
        f"attention){what}{extra}{drafted}"
    )


@functools.lru_cache(maxsize=64)
def _drafted(head: Model, backend_name: str, tp: int, graphs: tuple[DraftGraph, ...], argmax_block: int) -> int:
    """The reserved bytes of one capture stream's segments after a draft manager's ``graphs`` in
    their order (cached as :func:`_simulated`)."""
    be = backend(backend_name)
    return _reserved(
        forward_program(head, g.reqs, be, tp, pieces=True)
        if g.pieces
        else eagle_draft_program(
            head, g.reqs, g.tokens_per_request, g.steps, be, tp, argmax_block=argmax_block, attention_extra=g.extra
        )
        for g in graphs
    )


@functools.lru_cache(maxsize=64)
def _simulated(model: Model, backend_name: str, tp: int, graphs: tuple[Graph, ...]) -> int:
    """The reserved bytes of one private pool after ``graphs`` in their order. Cached: fit prices
    the same captures again for every fix it checks (a shorter context, fp8 KV) and every size
    list, and an engine's thousands of capture sizes (--max-cudagraph-capture-size 65536) take
    seconds each time."""
    be = backend(backend_name)
    return _reserved(
        forward_program(model, g.tokens, be, tp, logits=g.logits, attention_extra=g.extra, pieces=g.pieces)
        for g in graphs
    )


def _reserved(programs) -> int:
    """The reserved bytes of one private pool after ``programs`` captured in their order, each
    graph's blocks freed at its end."""
    pool = PoolSim()
    for prog in programs:
        pool.capture(prog, view=True)
    return pool.reserved
