"""Graph keys, planner side: expand a phase's variant axes, order its keys, predict each.

A phase that declares variant axes (``variants = { lora = ["lora", "nolora"] }``)
captures one graph per size and combination of labels (a graph key; step ids and
helpers: :mod:`capture_plan.schemas.keys`). What this module decides:

* **Expansion**: every combination of labels, the first axis outermost, labels in
  the order the spec lists them (:func:`phase_combos`).
* **Order**: ``size-major`` (per size in the phase's size order, every combination:
  SGLang's ``_capture_one_stream``) or ``variant-major`` (per combination, every
  size). Rules set it as they set the size order: a rule whose every ``require``
  names the same ``key_order`` forces it, two that force different ones conflict;
  else the last ``prefer.key_order``; else size-major (:func:`key_order`).
* **Programs**: a key a trace recorded (a capture with ``labels``) runs its own
  program (``recorded``); every other key of a size runs the program of that size (the
  trace's, or the analytic one). A label the reference step does not model
  (``lora=lora``: the reference has no LoRA layers; planner/data/phase_kinds.toml
  ``[axes.*].reference``) is then flagged approximate (:func:`key_fidelity`).
  A key field whose facts say its prediction is approximate
  (:data:`capture_plan.schemas.key_fields.KEY_FIELDS`; ``micro_batches`` > 1: the
  program runs the whole batch at once) flags its phase's graphs approximate too.
* **Pieces**: a piecewise capture split at every attention op has layers + 1 pieces;
  :func:`piece_bytes` runs the capture's program alone and splits the pool's growth
  at the attention calls (the analytic piecewise program marks them). A recorded
  trace does not mark them, and a piece count the model's structure does not give
  (a spec's ``pieces = N`` that is not layers + 1) is predicted as a whole graph
  only (empty per-piece list).
* **Warm-up-kept buffers** (``warmup_keeps = "outputs"``): the first warm-up of the
  phase allocates the outputs of the phase's largest graph outside every pool and
  the engine keeps them, reused by every later key (:func:`output_bytes`).

* **Micro-batch twins** (``twin_of``): a twin phase's key of each size and labels is
  captured right after its phase's key of the same size and labels, in its phase's
  order (vLLM: ``CudaGraphManager._init_candidates`` appends ``_maybe_ubatch_twin(desc)``
  right after ``desc``; planner/data/presets_vllm.toml ``[capture]``), not in a phase of
  its own after it (:func:`twin_phases`; the order itself is
  :func:`capture_plan.planner.schedule.sequence.capture_sequence`'s).

What it does not do: model LoRA's or an attention variant's own allocations
analytically (a trace of the engine's model records them), fit a labelled key's sizes
from a few recorded ones (each recorded key stands for itself), or a ragged verify
phase's slot count.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import msgspec

from capture_plan.schemas.capture_sequence import capture_key
from capture_plan.schemas.errors import ConstraintError
from capture_plan.schemas.key_fields import KEY_FIELDS, approximate_fields
from capture_plan.schemas.keys import expand_labels
from capture_plan.schemas.plan import Fidelity, KeyPrediction, Step, StepMemory
from capture_plan.schemas.spec import Model, Phase, Rule

from ..inputs.resources import variant_axes
from ..memory.allocator import PoolSim
from ..memory.program import CARRY, Alloc, Program
from ..memory.simulate import PoolSetup, simulate

if TYPE_CHECKING:
    from .sequence import Build

__all__ = [
    "Labels",
    "phase_combos",
    "key_order",
    "key_sequence",
    "piece_count",
    "piece_bytes",
    "output_bytes",
    "key_fidelity",
    "resolve_keys",
    "uses_keys",
    "keyed_steps",
    "key_predictions",
    "twin_phases",
]

#: a key's ``(axis, label)`` pairs in the phase's axis order
Labels = tuple[tuple[str, str], ...]


def phase_combos(phase: Phase) -> list[Labels]:
    """Every combination of the phase's labels (one empty one without variants)."""
    if phase.variants is msgspec.UNSET:
        return [()]
    return expand_labels(list(phase.variants.items()))


def key_order(phase: Phase, rules: Sequence[Rule]) -> tuple[str, str]:
    """(key order, the rule that set it: a rule id or ``"default"``) for ``phase``,
    from the rules that apply to it (see the module docstring). Two rules forcing
    different orders are a :class:`ConstraintError` naming both."""
    forced: list[tuple[str, str]] = []
    for r in rules:
        orders = {c.key_order for c in r.require}
        if r.require and len(orders) == 1 and msgspec.UNSET not in orders:
            forced.append((str(orders.pop()), r.id))
    if forced:
        first = forced[0]
        other = next((f for f in forced if f[0] != first[0]), None)
        if other is not None:
            raise ConstraintError(
                f"rules in conflict for phase {phase.name!r}: {first[1]} requires key_order={first[0]}, "
                f"{other[1]} requires key_order={other[0]}",
                where=f"phase {phase.name}",
                fix="remove or relax one of these rules in the spec",
            )
        return first
    preferred = [(str(r.prefer.key_order), r.id) for r in rules if r.prefer and r.prefer.key_order is not msgspec.UNSET]
    return preferred[-1] if preferred else ("size-major", "default")


def key_sequence(sizes: Sequence[int], combos: Sequence[Labels], order: str) -> list[tuple[int, Labels]]:
    """The keys of one phase in capture order: ``sizes`` already in the phase's size
    order; ``order`` a key order (size-major or variant-major)."""
    if order == "variant-major":
        return [(bs, c) for c in combos for bs in sizes]
    return [(bs, c) for bs in sizes for c in combos]


def twin_phases(phases: Sequence[Phase]) -> dict[str, str]:
    """Each micro-batch twin phase's name -> the phase it is the twin of (``twin_of``)."""
    return {p.name: p.twin_of for p in phases if p.twin_of is not msgspec.UNSET}


def piece_count(phase: Phase, model: Model) -> int | None:
    """The piece graphs of each capture of ``phase`` (None: not piecewise-declared)."""
    if phase.pieces is msgspec.UNSET:
        return None
    if phase.pieces == "attention":
        return (phase.layers or model.layers) + 1
    return phase.pieces


def piece_bytes(prog: Program, pieces: int, expandable: bool = False) -> list[int]:
    """Per piece, the pool's growth (reserved bytes) while that piece is captured,
    the capture run alone in a fresh pool: pieces end at the allocations the program
    marks (``Program.splits``: the attention call's output, which the piece before
    the eager call allocates) and the last one at the end. Their sum is the whole
    capture's pool. Empty when the program marks no split or its structure does not
    give ``pieces`` pieces (see the module docstring)."""
    splits = set(prog.splits)
    if not splits or prog.repeats * sum(1 for op in prog.body if type(op) is Alloc and op.id in splits) + 1 != pieces:
        return []
    pool = PoolSim(expandable=expandable)
    live: dict[int, object] = {}
    ends: list[int] = []

    def run(ops, marks: bool) -> None:
        for op in ops:
            if type(op) is Alloc:
                live[op.id] = pool.alloc(op.size)
                if marks and op.id in splits:
                    ends.append(pool.reserved)
            else:
                block = live.pop(op.id, None)
                if block is not None:
                    pool.free(block)  # pyright: ignore[reportArgumentType]

    run(prog.prologue, False)
    carried = live.pop(prog.carry_in, None) if prog.carry_in is not None else None
    for _ in range(prog.repeats):
        if carried is not None:
            live[CARRY] = carried
        run(prog.body, True)
        carried = live.pop(prog.carry_out, None)
    if carried is not None:
        live[CARRY] = carried
    run(prog.epilogue, False)
    ends.append(pool.reserved)
    return [b - a for a, b in zip([0, *ends], ends)]


def output_bytes(prog: Program) -> int:
    """Bytes of the blocks a capture returns (allocations of kind ``output`` it does not
    free): what a warm-up that keeps its outputs keeps."""
    events = prog.flatten()
    sizes = {e.id: e.size for e in events if e.op == "alloc" and e.kind == "output"}
    for e in events:
        if e.op == "free":
            sizes.pop(e.id, None)
    return sum(sizes.values())


def key_fidelity(
    base: Fidelity | None, labels: Labels, reference: Mapping[str, Sequence[str]], approximate: bool = False
) -> Fidelity:
    """A key's fidelity: the plan's (``base``), unless a label is one the reference
    step does not model (``reference``: axis -> labels it models) or a key field makes
    it ``approximate`` (:func:`~capture_plan.schemas.key_fields.approximate_fields`: a
    graph that runs micro-batches), then ``approximate``."""
    if approximate or any(label not in reference.get(axis, ()) for axis, label in labels):
        return "approximate"
    return base or "reference"


def resolve_keys(phases: Sequence[Phase], rules: dict[str, list[Rule]]) -> dict[str, tuple[list[Labels], str, str]]:
    """Per phase with variant axes: (its label combinations, its key order, the rule
    that set the order): what the optimizer and the step graph expand sizes by."""
    return {p.name: (phase_combos(p), *key_order(p, rules[p.name])) for p in phases if p.variants is not msgspec.UNSET}


def uses_keys(phase: Phase) -> bool:
    """Whether ``phase`` sets a graph-key field (its plan then records per-key predictions)."""
    unset = msgspec.UNSET
    return any(getattr(phase, f) is not unset for f in ("variants", "pieces", "stream", "warmup_keeps", *KEY_FIELDS))


def keyed_steps(b: Build, steps: list[Step], labels: dict[str, Labels]) -> list[Step]:
    """``steps`` with their graph-key fields: each capture and warm-up step's labels
    (``labels``: step id -> its labels, from the step graph), a capture's piece
    count, the stream a phase's graphs record on (its warm-ups run there too), and
    the bytes the first warm-up of a phase with ``warmup_keeps`` keeps: the outputs of
    the phase's largest graph (an engine sizes the buffers it keeps for the largest
    key and reuses them for the rest)."""
    phases, model, workload = b.resolved.by_name, b.resolved.spec.model, b.resolved.workload
    out: list[Step] = []
    kept: set[str] = set()
    for s in steps:
        p = phases[s.phase]
        fields: dict = {}
        if labels.get(s.id):
            fields["labels"] = [label for _, label in labels[s.id]]
        if s.op == "capture":
            n = piece_count(p, model)
            if n is not None:
                fields["pieces"] = n
        if s.op in ("capture", "warmup") and p.stream is not msgspec.UNSET:
            fields["stream"] = p.stream
        if s.op == "warmup" and p.warmup_keeps is not msgspec.UNSET and s.phase not in kept:
            kept.add(s.phase)
            fields["keeps"] = output_bytes(workload.program(s.phase, max(p.sizes)))
        out.append(msgspec.structs.replace(s, **fields) if fields else s)
    return out


def key_predictions(
    b: Build, steps: list[Step], timeline: list[StepMemory], base: Fidelity | None
) -> list[KeyPrediction]:
    """One :class:`KeyPrediction` per capture of ``b``'s sequence (the plan's capture steps,
    in step order, with ``timeline``, the pool after each step): the key's graph alone (its
    pieces too), the pool's growth where the plan captures it, what its warm-up keeps, and
    its fidelity (:func:`key_fidelity`)."""
    r = b.resolved
    reference = {name: axis.reference for name, axis in variant_axes().items()}
    alone: dict[tuple, tuple[int, list[int]]] = {}
    # what each warm-up keeps, by the key it runs (the warm-ups run in the sequence's order,
    # each right before a capture that has one)
    warmups = [s for s in steps if s.op == "warmup"]
    warmed = [c for c in b.sequence.captures if c.warmup is not None]
    keeps = {(c.phase, c.warmup, c.labels): s.keeps for s, c in zip(warmups, warmed) if s.keeps is not msgspec.UNSET}
    out: list[KeyPrediction] = []
    before = 0
    captures = iter(b.sequence.captures)
    for s, mem in zip(steps, timeline):
        if s.op != "capture":
            continue
        c = next(captures)
        p, st, labels = r.by_name[c.phase], b.strategies[c.phase], c.labels
        # keys of one size share its program unless a trace recorded the key itself
        recorded = (c.phase, c.bs, labels) in r.workload.programs if labels else False
        key = capture_key(c.phase, c.bs, labels if recorded else ())
        if key not in alone:
            graph = simulate([key], {c.phase: st}, r.workload, PoolSetup(r.expandable)).pool_bytes
            n = piece_count(p, r.spec.model)
            prog = r.workload.program(
                c.phase, c.bs, hoisted=st.workspace == "hoisted", labels=labels if recorded else ()
            )
            alone[key] = (graph, piece_bytes(prog, n, r.expandable) if n else [])
        graph, pieces = alone[key]
        rough = bool(approximate_fields(p))  # a key field the program does not model (micro-batches)
        out.append(
            KeyPrediction(
                step=s.id,
                graph_bytes=graph,
                added_bytes=max(0, mem.reserved - before),
                pieces=pieces,
                kept_bytes=int(keeps.get((c.phase, c.bs, labels), 0)),  # pyright: ignore[reportArgumentType]
                fidelity="recorded" if recorded and not rough else key_fidelity(base, labels, reference, rough),
            )
        )
        before = mem.reserved
    return out
