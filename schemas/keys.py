"""Graph keys: what one capture step captures, spelled the same by planner and executor.

A graph key is a phase, a capture size (requests; tokens for a phase of token-sized
graphs such as vLLM's), and one label per variant axis the phase declares (SGLang's
LoRA and attention-graph variants, vLLM's active LoRAs). Step ids spell it:
``capture/decode/64`` for a phase without variants (the ids of revision-2 plans,
unchanged), ``capture/decode/64/lora=nolora,attention=a`` with variants: every axis,
in the phase's declared order, ``axis=label`` joined by ``,``. Labels and axis names
cannot hold ``/``, ``,`` or ``=`` (their types, schemas/limits.py), so an id parses back
to one key.

``num_tokens`` beside ``num_reqs`` (vLLM's descriptors, SGLang's ``num_tokens = size *
captured_req_width``) is not stored per step: it is ``bs * tokens_per_request`` of the
step's phase (:attr:`GraphKey.tokens`). What this module does not cover: a ragged
verify phase whose slot count is not a multiple of its requests (one more field, on
the phase, when an engine needs it).

Also here, because the executor (which may not import the planner) calls it:
:func:`capture_memory`, the plan's answer to an engine's memory-profiling pass
(vLLM's ``profile_cudagraph_memory``): the whole capture's figure with its items.
Pure Python over a decoded :class:`~capture_plan.schemas.plan.Plan`; imports no torch.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

import msgspec

from .key_fields import KEY_FIELDS, KeyFields, key_fields, key_value, set_key_fields
from .plan import (
    KEYS_REVISION,
    KINDS_REVISION,
    PIECEWISE_BEFORE_KINDS_REVISION,
    REUSE_REVISION,
    DeviceCost,
    KeyPrediction,
    PhasePlan,
    Plan,
    Step,
)

__all__ = [
    "GraphKey",
    "CaptureMemory",
    "step_id",
    "parse_step_id",
    "label_suffix",
    "phase_axes",
    "step_labels",
    "step_key",
    "PlanIndex",
    "order_labels",
    "expand_labels",
    "uses_graph_keys",
    "needed_revision",
    "capture_memory",
]


class GraphKey(NamedTuple):
    """One graph an engine keys by: ``labels`` are ``(axis, label)`` pairs in the
    phase's axis order (empty without variants)."""

    phase: str
    bs: int
    labels: tuple[tuple[str, str], ...] = ()
    #: tokens the graph runs: bs * the phase's tokens_per_request (vLLM's num_tokens)
    tokens: int = 0
    #: the phase's graph-key fields (``micro_batches``: vLLM's num_ubatches, ...), each
    #: UNSET where it has the value a phase without it has
    #: (:func:`~capture_plan.schemas.key_fields.key_fields`)
    fields: KeyFields = KeyFields()

    @property
    def id(self) -> str:
        """The capture step's id of this key."""
        return step_id("capture", self.phase, self.bs, self.labels)

    def value(self, name: str) -> int:
        """Key field ``name``'s value (schemas/key_fields.py), where the key leaves it unset
        the value a phase without it has: ``key.value("micro_batches")`` is 1 for a graph
        run as one batch. KeyError for a name that is no key field."""
        return key_value(self.fields, name)


def label_suffix(labels: Iterable[tuple[str, str]]) -> str:
    """``[("lora", "nolora"), ("attention", "a")]`` -> ``"lora=nolora,attention=a"``."""
    return ",".join(f"{axis}={label}" for axis, label in labels)


def step_id(op: str, phase: str, bs: int, labels: Iterable[tuple[str, str]] = ()) -> str:
    """A step's id: ``<op>/<phase>/<bs>``, then ``/<axis>=<label>,...`` when the step
    has labels (``labels``: ``(axis, label)`` pairs in the phase's axis order)."""
    suffix = label_suffix(labels)
    return f"{op}/{phase}/{bs}/{suffix}" if suffix else f"{op}/{phase}/{bs}"


def parse_step_id(sid: str) -> tuple[str, str, int, tuple[tuple[str, str], ...]]:
    """``"capture/decode/64/lora=nolora"`` -> ``("capture", "decode", 64, (("lora", "nolora"),))``:
    what :func:`step_id` wrote. ValueError for an id it cannot have written."""
    parts = sid.split("/")
    if len(parts) not in (3, 4) or not parts[2].isdigit():
        raise ValueError(f"{sid!r} is not a step id (<op>/<phase>/<bs>[/<axis>=<label>,...])")
    labels: tuple[tuple[str, str], ...] = ()
    if len(parts) == 4:
        pairs = [p.partition("=") for p in parts[3].split(",")]
        if any(not a or not sep or not v for a, sep, v in pairs):
            raise ValueError(f"{sid!r} has labels that are not <axis>=<label>,...")
        labels = tuple((a, v) for a, _, v in pairs)
    return parts[0], parts[1], int(parts[2]), labels


def phase_axes(phase: PhasePlan) -> tuple[str, ...]:
    """The phase's variant axes, in declared order (empty without variants)."""
    return () if phase.variants is msgspec.UNSET else tuple(a.name for a in phase.variants)


def step_labels(phase: PhasePlan, step: Step) -> tuple[tuple[str, str], ...]:
    """``step``'s ``(axis, label)`` pairs (empty for a step without labels)."""
    if step.labels is msgspec.UNSET:
        return ()
    return tuple(zip(phase_axes(phase), step.labels))


def step_key(plan: Plan, step: Step) -> GraphKey:
    """The graph key ``step`` (of ``plan``) captures or warms up (:meth:`PlanIndex.key`)."""
    return PlanIndex.of(plan).key(step)


def _key(phase: PhasePlan, step: Step) -> GraphKey:
    return GraphKey(
        phase=step.phase,
        bs=step.bs,
        labels=step_labels(phase, step),
        tokens=step.bs * phase.tokens_per_request,
        fields=key_fields(phase),
    )


_CACHE_LOCK = threading.Lock()


class PlanIndex:
    """The one index of a plan's phases and steps by name, built once per plan
    (:meth:`of`; ``capture_plan.executor.load_plan`` builds it as it loads one): the
    phase of a name, the graph key of a step and the pools and streams the steps use,
    each answered in O(1). Code that needs a plan's phase by its name asks here
    instead of searching ``plan.phases`` (tests/test_plan_index.py checks none does)."""

    #: the last plans indexed, by id(plan), each with its plan (which keeps the id taken)
    _cache: dict[int, tuple[Plan, PlanIndex]] = {}
    _CACHED = 8

    def __init__(self, plan: Plan):
        self.plan = plan
        #: phase name -> the plan's phase, in the plan's order
        self.phases: dict[str, PhasePlan] = {p.name: p for p in plan.phases}
        #: phase name -> its kind
        self.kinds: dict[str, str] = {p.name: p.kind for p in plan.phases}
        #: step id -> the plan's step
        self.steps: dict[str, Step] = {s.id: s for s in plan.steps}
        #: the pools the plan's captures record into
        self.pools: frozenset[str] = frozenset(s.pool for s in plan.steps if s.op == "capture")
        #: the streams the plan's captures and warm-ups run on, and "capture"
        self.streams: frozenset[str] = frozenset(
            {s.stream for s in plan.steps if s.op in ("capture", "warmup")} | {"capture"}
        )

    @classmethod
    def of(cls, plan: Plan) -> PlanIndex:
        """The index of ``plan``: built at its first question, then kept with the plan
        (the last few plans asked about)."""
        hit = cls._cache.get(id(plan))
        if hit is not None and hit[0] is plan:
            return hit[1]
        index = cls(plan)
        with _CACHE_LOCK:  # a background capture's thread may ask too
            while len(cls._cache) >= cls._CACHED:
                cls._cache.pop(next(iter(cls._cache)))
            cls._cache[id(plan)] = (plan, index)
        return index

    def phase(self, name: str) -> PhasePlan:
        """The plan's phase ``name`` (KeyError for one it does not have)."""
        return self.phases[name]

    def key(self, step: Step) -> GraphKey:
        """The graph key ``step`` captures or warms up."""
        return _key(self.phases[step.phase], step)

    def piecewise(self, name: str) -> bool:
        """Whether phase ``name``'s graphs are pieces between eagerly run attention ops: as
        the plan records it (revision 6 on), or for an older plan, which did not, by the
        kinds that were piecewise then."""
        phase = self.phases[name]
        if phase.piecewise is not msgspec.UNSET:
            return phase.piecewise
        return self.plan.revision < KINDS_REVISION and phase.kind in PIECEWISE_BEFORE_KINDS_REVISION

    def labels(self, step: Step) -> tuple[tuple[str, str], ...]:
        """``step``'s ``(axis, label)`` pairs (empty for a step without labels)."""
        return step_labels(self.phases[step.phase], step)


def order_labels(phase: PhasePlan, given: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """``given`` (axis -> label, in any order: an engine's call such as
    ``loop.step("decode", 64, lora="nolora")``) as the phase's ``(axis, label)`` pairs in
    its axis order. ValueError, worded for one line, when an axis is missing or
    unknown or a label is not one of the axis's; the caller adds where and the fix."""
    axes = {} if phase.variants is msgspec.UNSET else {a.name: a.labels for a in phase.variants}
    unknown = sorted(set(given) - set(axes))
    if unknown:
        have = f"its axes are {', '.join(axes)}" if axes else "it has no variant axes"
        raise ValueError(f"phase {phase.name!r} has no variant axis {unknown[0]!r} ({have})")
    missing = [a for a in axes if a not in given]
    if missing:
        raise ValueError(f"phase {phase.name!r} keys its graphs by {', '.join(axes)}: no label for {missing[0]!r}")
    for axis, labels in axes.items():
        if given[axis] not in labels:
            raise ValueError(f"{axis}={given[axis]!r} is not a label of phase {phase.name!r} ({', '.join(labels)})")
    return tuple((a, given[a]) for a in axes)


def expand_labels(axes: Sequence[tuple[str, Sequence[str]]]) -> list[tuple[tuple[str, str], ...]]:
    """Every combination of labels, the first axis outermost, each axis's labels in
    their order (SGLang's nesting: per LoRA variant, per attention variant). One
    empty combination for no axes."""
    combos: list[tuple[tuple[str, str], ...]] = [()]
    for axis, labels in axes:
        combos = [c + ((axis, label),) for c in combos for label in labels]
    return combos


def uses_graph_keys(plan: Plan) -> bool:
    """Whether ``plan`` uses a revision-3 field (so needs
    :data:`~capture_plan.schemas.plan.KEYS_REVISION`)."""
    unset = msgspec.UNSET
    phased = any(
        p.variants is not unset
        or p.pieces is not unset
        or set_key_fields(p)
        or p.warmup_keeps is not unset
        or p.strategy.key_order is not unset
        for p in plan.phases
    )
    return phased or bool(plan.predicted.keys) or any(s.keeps is not unset for s in plan.steps)


def needed_revision(plan: Plan, base: int = 2) -> int:
    """The lowest revision ``plan`` can be written as: :data:`KEYS_REVISION` when it uses
    graph keys, else ``base`` (the revision before them), so plans without graph keys
    keep their bytes; :data:`KINDS_REVISION` when it records a kind's property;
    :data:`REUSE_REVISION` when a phase decides executable reuse; the ``revision`` of
    each key field a phase sets (:data:`~capture_plan.schemas.key_fields.KEY_FIELDS`)."""
    need = [base, *(KEY_FIELDS[n].revision for p in plan.phases for n in set_key_fields(p))]
    if any(p.reuse is not msgspec.UNSET for p in plan.phases):
        need.append(REUSE_REVISION)
    if any(p.piecewise is not msgspec.UNSET for p in plan.phases):
        need.append(KINDS_REVISION)
    if uses_graph_keys(plan):
        need.append(KEYS_REVISION)
    return max(need)


class CaptureMemory(msgspec.Struct, frozen=True, kw_only=True):
    """The plan's figure for the whole capture, as an engine's memory-profiling pass
    wants it (vLLM's ``profile_cudagraph_memory`` returns one number of bytes)."""

    #: the figure to reserve: every item's bytes, the known ones only when some are
    #: unknown (then ``complete`` is False)
    bytes: int
    #: False when an item is unknown (never measured for this device): ``bytes`` is then a
    #: lower bound; calibrate the plan (``planner build --calibration``) to complete it
    complete: bool
    #: the most free memory capture takes at any moment, when the plan knows it
    peak_bytes: int | None
    #: the items (pool, hoisted, stream-workspace, allocator-other, graph-exec, warmup-kept)
    items: list[DeviceCost]
    #: per graph key, for a plan with graph keys (revision 3)
    keys: list[KeyPrediction]
    #: which model code the figures describe ("recorded", "reference", "approximate";
    #: "" for a plan from before revision 2)
    fidelity: str


def capture_memory(plan: Plan) -> CaptureMemory:
    """The plan's whole-capture figure with its items (see :class:`CaptureMemory`).

    Reads only ``plan.predicted``: for a revision-2 or later plan its device items
    (``predicted.device``); for an older one the pool and the hoisted workspace, the
    only items it records (``complete`` False). It does not measure anything nor
    re-run the planner: an engine's profiling pass asks it instead of capturing."""
    pred = plan.predicted
    if pred.device is not None and pred.device.items:
        items = list(pred.device.items)
        peak = pred.device.peak_bytes
    else:
        items = [
            DeviceCost(name="pool", bytes=pred.pool_bytes, provenance="simulated", source="allocator simulation"),
            DeviceCost(
                name="hoisted", bytes=pred.hoisted_bytes, provenance="simulated", source="the plan's provision steps"
            ),
        ]
        peak = None
    known = [i.bytes for i in items if i.bytes is not None]
    complete = len(known) == len(items) and (pred.device is not None and pred.device.total_bytes is not None)
    total = pred.device.total_bytes if complete and pred.device is not None else sum(known)
    return CaptureMemory(
        bytes=int(total or 0),
        complete=complete,
        peak_bytes=peak,
        items=items,
        keys=list(pred.keys),
        fidelity=pred.fidelity or "",
    )
