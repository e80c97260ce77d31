"""The analytic memory model: what one capture allocates, derived from the spec's model dimensions.

A Llama-style decoder step (RMSNorm with a float32 upcast, fused QKV, attention, O-proj,
gated MLP), the final norm, bf16 logits and their float32 copy (the output), the backend's
per-call workspace and log-sum-exp, written as typed ``Alloc``/``Free`` ops
(:class:`Program` of planner/memory/program.py). Measured on an H200 with torch 2.11,
cuBLAS's workspace is not allocated in the graph pool, so the model has none (a recorded
trace would show one as ``library`` blocks). One builder per kind of graph
(:data:`PROGRAMS`); which phase kind runs which builder is data
(planner/data/phase_kinds.toml: :data:`PHASE_KINDS`). A builder runs once over every size of
a phase at once (:class:`Batches`); planner/memory/workload.py indexes the programs it
gives, or a recorded trace's, per capture.

Layers repeat: a builder emits one layer as a repeated body, and the simulator runs it layer
by layer until the pool's state recurs, then skips the whole cycles that remain (exact: the
allocator is deterministic). Not modelled: rotary caches, sampling, LoRA, MoE routing, and
per-rank differences beyond dividing heads and MLP by ``tp``.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, cast

import msgspec

from capture_plan.schemas.errors import InputError
from capture_plan.schemas.spec import Model, Phase, phase_model
from capture_plan.schemas.trace import CaptureTrace, EventKind

from ..inputs.resources import Backend
from .program import CARRY, Alloc, Free, Op, Program

__all__ = [
    "Batches",
    "PHASE_KINDS",
    "PhaseKindModel",
    "PROGRAMS",
    "analytic_program",
    "analytic_capture",
    "eagle_draft_program",
    "forward_program",
    "workspace_bytes",
]


class Batches:
    """Every batch size of a phase at once, for the analytic builders: arithmetic on a
    ``Batches`` applies to each size (elementwise, in the order written, so each value is
    what the same expression gives for that size alone). A builder run once with
    ``bs=Batches(sizes)`` emits the op structure, which no size changes (only allocation
    sizes depend on ``bs``), with each allocation's size for all sizes together
    (:meth:`Workload.analytic`). Not supported: comparing sizes, or branching on one (a
    builder whose ops differ by size must not be run this way; truth is refused unless
    every size agrees).

    Products by integers, most of a builder's arithmetic, are kept as one factor of the
    sizes (``values`` computes them when read): integer products are exact in any grouping,
    so ``(bs * a) * b`` is each ``bs * (a * b)``."""

    __slots__ = ("base", "factor", "_values")

    def __init__(self, values: Iterable[int | float], factor: int = 1) -> None:
        self.base = tuple(values)
        self.factor = factor
        self._values: tuple | None = None if factor != 1 else self.base

    @property
    def values(self) -> tuple:
        """Each size's value."""
        if self._values is None:
            f = self.factor
            self._values = tuple([v * f for v in self.base])
        return self._values

    def _integral(self) -> bool:
        # every value is an int (one type for all: each came from the same expression)
        return not self.base or type(self.base[0]) is int

    def _apply(self, other, op, reflected: bool = False) -> Batches:
        mine = self.values
        if type(other) is Batches:
            theirs = other.values
            return Batches(map(op, theirs, mine) if reflected else map(op, mine, theirs))
        if reflected:
            return Batches([op(other, v) for v in mine])
        return Batches([op(v, other) for v in mine])

    def __mul__(self, other) -> Batches:
        if type(other) is int and self._integral():
            return Batches(self.base, self.factor * other)
        return self._apply(other, operator.mul)

    def __rmul__(self, other) -> Batches:
        if type(other) is int and self._integral():
            return Batches(self.base, other * self.factor)
        return self._apply(other, operator.mul, True)

    def __add__(self, other) -> Batches:
        return self._apply(other, operator.add)

    def __radd__(self, other) -> Batches:
        return self._apply(other, operator.add, True)

    def __floordiv__(self, other) -> Batches:
        return self._apply(other, operator.floordiv)

    def __rfloordiv__(self, other) -> Batches:
        return self._apply(other, operator.floordiv, True)

    def __neg__(self) -> Batches:
        return Batches([-v for v in self.values])

    def __bool__(self) -> bool:
        truth = {bool(v) for v in self.values}
        if len(truth) > 1:
            raise ValueError("the sizes disagree on a branch: this builder's ops differ by batch size")
        return truth == {True}

    def __repr__(self) -> str:
        return f"Batches({list(self.values)})"


def _int(x: float) -> int:
    """``int(x)`` of a number, or of each of a :class:`Batches`' (typed as the number a
    builder sees)."""
    value: Any = x
    return cast(int, Batches(map(int, value.values))) if type(value) is Batches else int(x)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def workspace_bytes(backend: Backend, bs: int, tokens_per_request: int) -> int:
    """Bytes of the backend's per-call workspace at batch ``bs`` (0: none)."""
    ws = backend.workspace
    if ws is None:
        return 0
    return ws.elem_bytes * (ws.per_request * _round_up(bs, ws.round_batch_to) + ws.fixed)


class _Ops:
    def __init__(self) -> None:
        self.ops: list[Op] = []
        self._next = 0

    def alloc(self, size: int, kind: EventKind = "temp") -> int:
        i = self._next
        self._next += 1
        self.ops.append(Alloc(size, i, kind))
        return i

    def free(self, *ids: int) -> None:
        self.ops.extend(map(Free, ids))

    def take(self) -> tuple[Op, ...]:
        ops, self.ops = tuple(self.ops), []
        return ops


def _rmsnorm(ev: _Ops, tokens: int, hidden: int, d: int, kind: EventKind = "temp") -> int:
    """x.float(); pow(2).mean(-1); + eps; rsqrt; x * r; .to(bf16); * weight (its result of ``kind``)."""
    x32 = ev.alloc(tokens * hidden * 4)
    pw = ev.alloc(tokens * hidden * 4)
    var = ev.alloc(tokens * 4)
    ev.free(pw)
    ve = ev.alloc(tokens * 4)
    rs = ev.alloc(tokens * 4)
    ev.free(ve)
    y32 = ev.alloc(tokens * hidden * 4)
    ev.free(rs)
    yb = ev.alloc(tokens * hidden * d)
    ev.free(y32)
    out = ev.alloc(tokens * hidden * d, kind)
    ev.free(yb, x32, var)
    return out


def _attention(ev: _Ops, s: _Shape, bs: int, tpr: int, in_graph: bool = True) -> int:
    """The backend call over ``s``'s heads: its output, float32 log-sum-exp, per-call
    workspace, partials. ``in_graph=False`` (a piecewise capture): the call runs eagerly
    between two captured pieces, so only its output buffer, which the piece before it
    allocates, is in the pool."""
    backend, heads, hd, d = s.backend, s.heads, s.model.head_dim, s.model.dtype_bytes
    tokens = bs * tpr
    out = ev.alloc(tokens * heads * hd * d)
    if not in_graph:
        return out
    lse = ev.alloc(tokens * heads * 4) if backend.lse else None
    ws = workspace_bytes(backend, bs, tpr)
    if ws:
        ev.free(ev.alloc(ws, "workspace"))
    factor = backend.attention_temp_factor
    if factor:
        ev.free(ev.alloc(_int(tokens * heads * hd * factor)))
    if s.attention_extra:
        ev.free(ev.alloc(s.attention_extra))
    if lse is not None:
        ev.free(lse)
    return out


class _Shape(msgspec.Struct, frozen=True):
    """Per-rank dimensions of one analytic program."""

    model: Model
    backend: Backend
    heads: int
    kv_heads: int
    inter: int
    #: bytes each attention call allocates and frees besides the backend's own (forward_program)
    attention_extra: int = 0

    @classmethod
    def of(cls, model: Model, backend: Backend, tp: int) -> _Shape:
        return cls(
            model, backend, max(1, model.heads // tp), max(1, model.kv_heads // tp), max(1, model.intermediate // tp)
        )


def _decoder_layer(
    ev: _Ops,
    s: _Shape,
    h_in: int,
    bs: int,
    tpr: int,
    attention_in_graph: bool = True,
    splits: list | None = None,
    input_norm: bool = True,
) -> int:
    """One decoder layer over ``bs * tpr`` tokens; frees ``h_in``, returns the new hidden state.
    ``splits``: the attention output's id is appended (a piece graph ends after it);
    ``input_norm`` False: the layer's input norm is an identity (an EAGLE head's first layer)."""
    d, hd, h = s.model.dtype_bytes, s.model.head_dim, s.model.hidden
    tokens = bs * tpr
    x = _rmsnorm(ev, tokens, h, d) if input_norm else None
    qkv = ev.alloc(tokens * (s.heads + 2 * s.kv_heads) * hd * d)
    attn = _attention(ev, s, bs, tpr, attention_in_graph)
    if splits is not None:
        splits.append(attn)
    o = ev.alloc(tokens * h * d)  # O projection; a TP all-reduce runs in place
    res = ev.alloc(tokens * h * d)
    x2 = _rmsnorm(ev, tokens, h, d)
    gate_up = ev.alloc(tokens * 2 * s.inter * d)
    act = ev.alloc(tokens * s.inter * d)
    prod = ev.alloc(tokens * s.inter * d)
    ev.free(act)
    down = ev.alloc(tokens * h * d)
    ev.free(prod)
    new_hidden = ev.alloc(tokens * h * d)
    ev.free(*(() if x is None else (x,)), qkv, attn, o, res, x2, gate_up, down, h_in)  # the layer returns
    return new_hidden


def _logits(ev: _Ops, s: _Shape, rows: int, kind: EventKind) -> tuple[int, int]:
    """Final norm and lm_head over ``rows`` hidden states, then the float32
    copy (of ``kind``); returns (float32 logits, the normed input still alive)."""
    m = s.model
    x = _rmsnorm(ev, rows, m.hidden, m.dtype_bytes)
    logits = ev.alloc(rows * m.vocab * m.dtype_bytes)
    out = ev.alloc(rows * m.vocab * m.logits_dtype_bytes, kind)
    ev.free(logits)
    return out, x


def _forward(
    s: _Shape, phase: Phase, bs: int, head: Callable[[_Ops, int], EventKind | None], attention_in_graph: bool = True
) -> Program:
    """The model's forward over ``bs * tokens_per_request`` tokens: the embedding (the
    prologue), ``phase.layers`` decoder layers (the body), then ``head(ops, tokens)``, the
    epilogue, which returns the kind of output the last hidden state becomes (None: it is
    freed). With ``attention_in_graph`` False each attention call ends a piece (``splits``)."""
    ev = _Ops()
    m, tpr = s.model, phase.tokens_per_request
    tokens = bs * tpr
    embedding = ev.alloc(tokens * m.hidden * m.dtype_bytes)
    prologue = ev.take()
    splits: list[int] = []
    new_hidden = _decoder_layer(ev, s, CARRY, bs, tpr, attention_in_graph, splits)
    body = ev.take()
    carry_kind = head(ev, tokens)
    if carry_kind is None:
        ev.free(CARRY)
    return Program(
        prologue=prologue,
        body=body,
        repeats=phase.layers or s.model.layers,
        epilogue=ev.take(),
        carry_in=embedding,
        carry_out=new_hidden,
        carry_kind=carry_kind,
        # a piecewise capture's pieces end at each eager attention call
        splits=() if attention_in_graph else tuple(splits),
    )


def _target_program(s: _Shape, phase: Phase, bs: int) -> Program:
    """decode / target_verify: the target over ``tokens_per_request`` tokens,
    logits of every token returned (target_verify also returns the last
    hidden state, which the draft reads)."""

    def head(ev: _Ops, tokens: int) -> EventKind | None:
        _, x = _logits(ev, s, tokens, "output")
        ev.free(x)
        return "output" if PHASE_KINDS[phase.kind].returns_hidden else None

    return _forward(s, phase, bs, head)


def _hidden_program(s: _Shape, phase: Phase, bs: int, attention_in_graph: bool = True) -> Program:
    """vLLM's graphs: the model's forward over ``bs * tokens_per_request`` tokens,
    up to the final norm, whose result is the output (vLLM computes the logits
    outside every graph, so no lm_head and no logits here)."""

    def head(ev: _Ops, tokens: int) -> EventKind | None:
        _rmsnorm(ev, tokens, s.model.hidden, s.model.dtype_bytes, "output")
        return None

    return _forward(s, phase, bs, head, attention_in_graph)


def forward_program(
    model: Model,
    bs: int,
    backend: Backend,
    tp: int = 1,
    *,
    logits: bool = False,
    attention_extra: int = 0,
    pieces: bool = False,
) -> Program:
    """An engine's graph of ``bs`` tokens (one per request) whose outputs live outside its
    pool: the layers and the final norm, and with ``logits`` the model-dtype logits over
    ``model.vocab`` rows after it (with ``tp`` > 1 the rank's shard, then the all-gathered
    rows), each freed at the graph's end; ``attention_extra``: bytes each attention call
    allocates and frees besides ``backend``'s own (an engine's split-KV accumulators);
    ``pieces``: the graph is pieces between attention calls run eagerly (vLLM's PIECEWISE,
    SGLang's breakable prefill graphs), so only each call's output is in the pool. SGLang
    0.5.23's decode graph is such a graph: its float32 logits go into a buffer the engine
    made before capture (graph_shared_output.py); vLLM's graphs end at the final norm, their
    output copied into a persistent buffer. Not a phase kind: ``planner fit`` prices an
    engine's default graphs with it."""
    s = msgspec.structs.replace(_Shape.of(model, backend, tp), attention_extra=attention_extra)
    phase = Phase(name="forward", kind="full", sizes=[1])

    def head(ev: _Ops, tokens: int) -> EventKind | None:
        x = _rmsnorm(ev, tokens, model.hidden, model.dtype_bytes)
        if logits:
            shard = ev.alloc(tokens * model.vocab // tp * model.dtype_bytes) if tp > 1 else None
            full = ev.alloc(tokens * model.vocab * model.dtype_bytes)
            ev.free(full, *(() if shard is None else (shard,)))
        ev.free(x)
        return None

    return _forward(s, phase, bs, head, attention_in_graph=not pieces)


def eagle_draft_program(
    model: Model,
    reqs: int,
    tokens_per_request: int,
    steps: int,
    backend: Backend,
    tp: int = 1,
    *,
    argmax_block: int = 0,
    attention_extra: int = 0,
) -> Program:
    """vLLM's EAGLE draft graph (0.33.0 and 0.34.0: v1/worker/gpu/spec_decode/target_dependent_ar/
    speculator.py ``_prefill`` and ``_decode``), whose outputs live outside its pool: ``steps``
    steps over ``reqs`` requests of ``tokens_per_request`` tokens each (the draft prefill
    manager's graphs: one step of num_speculative_tokens + 1 tokens a request; the draft decode
    manager's: the fused multi-step decode's steps of one token). ``model``: the draft's layers
    at the target's padded vocabulary (the head is the target's lm_head, shared).

    A step: (prefill) the requests' positions gathered and their successors (int64, alive to the
    step's end); the draft's forward (llama_eagle.py LlamaModel.forward): the embedding (alive to
    the forward's return), its concatenation with the target's hidden states [T, 2 x hidden],
    fc to hidden, the layers (the first one's input norm an identity), ``hidden + residual``
    (no final norm); (prefill) each request's last token's hidden state gathered; its logits
    over the vocabulary in the model dtype (LogitsProcessor: no float32 copy; with ``tp`` > 1 the
    rank's shard, then the gathered rows); the greedy argmax (sample_draft's default greedy
    path): with ``argmax_block`` (0.34.0's greedy_argmax) its int64 result, then float32 and
    int32 partials [reqs, ceil(vocab / block)] (under ``argmax_block`` columns its fallback's
    NaN mask and masked copy), freed at its return; else torch's argmax's int64 result. Every
    tensor dies by the step's end (the speculator copies the results into its persistent
    buffers). Not counted: the FA scheduler metadata a fused step rebuilds (a
    few KiB); the forward is the eager one (vLLM compiles the head's forward).
    ``attention_extra`` as :func:`forward_program`'s."""
    s = msgspec.structs.replace(_Shape.of(model, backend, tp), attention_extra=attention_extra)
    ev = _Ops()
    m, tpr = model, tokens_per_request
    tokens, d = reqs * tpr, model.dtype_bytes

    def forward_in() -> tuple[tuple[int, ...], int]:
        kept = (ev.alloc(reqs * 8), ev.alloc(reqs * 8)) if tpr > 1 else ()  # positions, sample_src_positions
        embeds = ev.alloc(tokens * m.hidden * d)
        cat = ev.alloc(tokens * 2 * m.hidden * d)
        fc = ev.alloc(tokens * m.hidden * d)
        ev.free(cat)
        return (*kept, embeds), fc

    def tail(h: int, kept: tuple[int, ...]) -> None:
        out = ev.alloc(tokens * m.hidden * d)  # hidden_states + residual: the forward returns it twice
        ev.free(h, kept[-1])  # the layers' output and the embedding die with the forward
        rows = (ev.alloc(reqs * m.hidden * d),) if tpr > 1 else ()  # last_hidden_states[last_token_indices]
        shard = ev.alloc(reqs * m.vocab // tp * d) if tp > 1 else None
        logits = ev.alloc(reqs * m.vocab * d)
        if shard is not None:
            ev.free(shard)
        sampled = ev.alloc(reqs * 8)
        if argmax_block and m.vocab < argmax_block:  # greedy_argmax's fallback: a NaN mask, a masked copy
            ev.free(ev.alloc(reqs * m.vocab), ev.alloc(reqs * m.vocab * d))
        elif argmax_block:
            splits = -(-m.vocab // argmax_block)
            ev.free(ev.alloc(reqs * splits * 4), ev.alloc(reqs * splits * 4))
        ev.free(logits, sampled, out, *rows, *kept[:-1])

    kept, carry = forward_in()
    prologue = ev.take()
    first = _decoder_layer(ev, s, CARRY, reqs, tpr, input_norm=False)
    body = ev.take()
    tail(CARRY, kept)
    for _ in range(steps - 1):
        kept, h = forward_in()
        for i in range(m.layers):
            h = _decoder_layer(ev, s, h, reqs, tpr, input_norm=i > 0)
        tail(h, kept)
    # the body is the first layer alone: a head of several layers repeats it with its input
    # norm an identity each time, a small undercount (an rmsnorm's temporaries a layer)
    return Program(prologue=prologue, body=body, repeats=m.layers, epilogue=ev.take(), carry_in=carry, carry_out=first)


def _piecewise_program(s: _Shape, phase: Phase, bs: int) -> Program:
    """vLLM's PIECEWISE capture at ``bs`` tokens: the pieces between attention
    ops are graphs captured one after another into one pool, with the attention
    calls run eagerly in between. The pool sees the allocations of
    :func:`_hidden_program` except the attention calls' own (log-sum-exp,
    workspace, partials), which land in the ordinary allocator; a capture
    ending between two pieces changes nothing for the blocks (same stream, same
    pool). The plan's one capture step stands for all pieces of one size."""
    return _hidden_program(s, phase, bs, attention_in_graph=False)


def _topk(ev: _Ops, rows: int, k: int, kind: EventKind = "temp") -> tuple[int, int]:
    """``probs.topk(k)``: float32 values and int64 indices."""
    return ev.alloc(rows * k * 4, kind), ev.alloc(rows * k * 8, kind)


def _draft_extend_program(s: _Shape, phase: Phase, bs: int) -> Program:
    """The draft over ``tokens_per_request`` tokens per request (embedding
    plus the target's hidden state), then softmax and top-k of the last
    accepted token only: its logits are (bs, vocab), not one row per token."""
    ev = _Ops()
    m, tpr = s.model, phase.tokens_per_request
    tokens = bs * tpr
    emb = ev.alloc(tokens * m.hidden * m.dtype_bytes)
    x_in = ev.alloc(tokens * m.hidden * m.dtype_bytes)
    ev.free(emb)
    prologue = ev.take()
    new_hidden = _decoder_layer(ev, s, CARRY, bs, tpr)
    body = ev.take()
    ev.alloc(bs * m.hidden * m.dtype_bytes, "output")  # the last accepted token's hidden state
    logits, x = _logits(ev, s, bs, "temp")
    ev.free(x)
    probs = ev.alloc(bs * m.vocab * 4)
    ev.free(logits)
    vals, idx = _topk(ev, bs, phase.topk, "output")
    ev.free(probs, CARRY)
    return Program(
        prologue=prologue,
        body=body,
        repeats=phase.layers or m.layers,
        epilogue=ev.take(),
        carry_in=x_in,
        carry_out=new_hidden,
    )


def _draft_decode_program(s: _Shape, phase: Phase, bs: int) -> Program:
    """``steps`` draft steps in one graph over ``bs * topk`` rows: each step
    embeds the candidates, runs the draft's layers, softmax over the vocabulary
    and a top-k of top-k; the chosen parents' hidden states carry into the
    next step. The repeated body is one step (its layers inline)."""
    ev = _Ops()
    m, k = s.model, phase.topk
    rows = bs * k
    for size in (bs * phase.steps * k * 8, bs * phase.steps * k * 4, bs * phase.steps * k * 8):
        ev.alloc(size, "output")  # draft ids, scores, token locations
    prologue = ev.take()  # step 0 reads the engine's static candidates: no pool block
    emb = ev.alloc(rows * m.hidden * m.dtype_bytes)
    h = ev.alloc(rows * m.hidden * m.dtype_bytes)
    ev.free(emb)
    for _ in range(phase.layers or m.layers):
        h = _decoder_layer(ev, s, h, rows, 1)
    logits, x = _logits(ev, s, rows, "temp")
    ev.free(x)
    probs = ev.alloc(rows * m.vocab * 4)
    ev.free(logits)
    vals, idx = _topk(ev, rows, k)
    joint = ev.alloc(rows * k * 4)
    bvals, bidx = _topk(ev, bs, k)
    new_hidden = ev.alloc(rows * m.hidden * m.dtype_bytes)
    ev.free(probs, vals, idx, joint, bvals, bidx, h, CARRY)
    body = ev.take()
    ev.free(CARRY)
    return Program(
        prologue=prologue, body=body, repeats=phase.steps, epilogue=ev.take(), carry_in=None, carry_out=new_hidden
    )


#: the analytic program builders a phase kind may name in
#: planner/data/phase_kinds.toml (``program = "..."``): behaviour is code,
#: which kind uses which builder is data
PROGRAMS: dict[str, Callable[[_Shape, Phase, int], Program]] = {
    # the target over every token (logits of each)
    "target": _target_program,
    # the draft over the accepted tokens (logits of the last)
    "draft_extend": _draft_extend_program,
    # the draft's tree steps
    "draft_decode": _draft_decode_program,
    # vLLM's FULL graphs: the forward up to the final norm (no logits)
    "hidden": _hidden_program,
    # vLLM's PIECEWISE graphs: the same, attention run eagerly between the pieces
    "piecewise": _piecewise_program,
}


class PhaseKindModel(msgspec.Struct, frozen=True):
    """What the analytic model runs for one phase kind (a ``[kinds.NAME]``
    table of planner/data/phase_kinds.toml, its builder resolved)."""

    #: builds the capture's program (one of :data:`PROGRAMS`)
    program: Callable[[_Shape, Phase, int], Program]
    #: the graph also returns the last layer's hidden state (the draft reads it)
    returns_hidden: bool = False


@functools.cache
def _phase_kind_models() -> dict[str, PhaseKindModel]:
    from ..inputs.resources import phase_kinds

    models = {}
    for name, kind in phase_kinds().items():
        if kind.program not in PROGRAMS:
            raise InputError(
                f"unknown program {kind.program!r}",
                where=f"planner/data/phase_kinds.toml: $.kinds.{name}.program",
                fix=f"use one of {', '.join(sorted(PROGRAMS))} (a new one is a builder in "
                "planner/memory/analytic.py's PROGRAMS)",
            )
        models[name] = PhaseKindModel(PROGRAMS[kind.program], returns_hidden=kind.returns_hidden)
    return models


class _PhaseKinds(Mapping[str, PhaseKindModel]):
    """A read-only view of phase_kinds.toml's kinds as :class:`PhaseKindModel`,
    read when first used (so a test that swaps the data file and clears
    ``_phase_kind_models``'s cache sees its kinds)."""

    def __getitem__(self, kind: str) -> PhaseKindModel:
        return _phase_kind_models()[kind]

    def __iter__(self) -> Iterator[str]:
        return iter(_phase_kind_models())

    def __len__(self) -> int:
        return len(_phase_kind_models())


#: every phase kind a spec may name, from planner/data/phase_kinds.toml
PHASE_KINDS: Mapping[str, PhaseKindModel] = _PhaseKinds()


def analytic_program(model: Model, phase: Phase, bs: int, backend: Backend, tp: int = 1) -> Program:
    """The allocations of capturing ``phase`` at batch ``bs``, with a repeated body.

    Mirrors a straightforward PyTorch engine step (references/decode.py and
    references/speculative.py are such steps): each layer is a function whose
    temporaries die when it returns, in the order CPython releases its
    locals; bf16 logits, then the float32 copy that is returned. A phase
    with its own dimensions (``[phases.model]``, a draft) uses them in place
    of ``model``'s. Small
    metadata tensors (slots, page tables, top-k scratch) are left out: they
    are bytes against the megabytes of activations and logits.
    """
    return PHASE_KINDS[phase.kind].program(_Shape.of(phase_model(model, phase), backend, tp), phase, bs)


def analytic_capture(model: Model, phase: Phase, bs: int, backend: Backend, tp: int = 1) -> CaptureTrace:
    """:func:`analytic_program` written out as a flat trace (every layer)."""
    return CaptureTrace(phase=phase.name, bs=bs, events=analytic_program(model, phase, bs, backend, tp).flatten())
