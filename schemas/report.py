"""Capture report: what the executor measured against what the plan predicted.

Every number is a size, a count or seconds: >= 0 by its type (published by
``planner schema report``)."""

from __future__ import annotations

import msgspec

from .limits import ByteDelta, NonNegative, NonNegativeFloat

__all__ = [
    "ReportStruct",
    "StepMeasurement",
    "DeviceItem",
    "DeviceView",
    "ReportModel",
    "ReuseGroup",
    "ReuseRefusal",
    "ExecReuse",
    "CaptureReport",
    "DEVICE_ITEMS",
]

#: the items of a report's device view, in the order it lists them
#: pool: the graph pools' segments; hoisted: workspaces the plan hoists out of the
#: pools; allocator-held: other caching-allocator memory allocated since capture began and
#: still in use (the capture stream's cuBLAS workspace); allocator-cached: free blocks
#: left cached in the ordinary allocator (capture leaves none: 0 is the expected figure);
#: outside-allocator: device memory taken outside the caching allocator (the driver's
#: cost of the process's first graph capture)
DEVICE_ITEMS = ("pool", "hoisted", "allocator-held", "allocator-cached", "outside-allocator")


# Subclasses repeat frozen=True: msgspec inherits it, but a type checker reads
# a dataclass_transform class without it as not frozen (and refuses that).
class ReportStruct(msgspec.Struct, frozen=True, kw_only=True):
    """Base of report types (lenient: reports are read across revisions)."""


class StepMeasurement(ReportStruct, frozen=True, kw_only=True):
    step: NonNegative
    id: str
    #: measured reserved bytes of the plan's pools after the step
    reserved: NonNegative
    predicted_reserved: NonNegative
    #: the step's wall time on the host: a warm-up step its eager runs; a capture step its
    #: graph's recording and instantiation, from the end of its warm-ups (or from the step's
    #: start) until its outputs were held, the engine's eager work between them included
    #: (reports written before 8b0d8aa counted only the holding; where an engine runs its
    #: warm-ups outside ``warmup()`` and records the graph itself, ``hold(graph=)``, the
    #: warm-up steps hold the recording too); a provision its allocation
    seconds: NonNegativeFloat
    #: free device memory after the step (``torch.cuda.mem_get_info``); None where not measured
    free: NonNegative | None = None
    #: the caching allocator's reserved bytes after the step, every pool together (None: not measured)
    allocator_reserved: NonNegative | None = None
    #: a warm-up step: the peak memory its scratch pool reserved (returned when the step ended)
    scratch: NonNegative | None = None
    #: a capture step: the nodes of its graph (kernels, memsets, copies), which the driver
    #: memory of its instantiation grows with; None where not counted (an engine's own graph)
    graph_nodes: NonNegative | None = None
    #: a capture step: the median seconds of one replay of its graph, measured after capture
    #: (``capture_plan.executor.timing``); UNSET, and left out of the file, where not measured
    replay_seconds: NonNegativeFloat | msgspec.UnsetType = msgspec.UNSET


class DeviceItem(ReportStruct, frozen=True, kw_only=True):
    """One part of the free device memory a capture took."""

    #: one of :data:`DEVICE_ITEMS`
    name: str
    #: signed: an item is a difference of two readings, and memory given back while the
    #: capture ran (a buffer the target freed, blocks another process released) makes it
    #: negative; the executor reports what it measured, and the reader takes it
    bytes: ByteDelta
    #: what it is and why it is there
    cause: str = ""


class DeviceView(ReportStruct, frozen=True, kw_only=True):
    """Free device memory before and after ``capture()``, itemized.

    Measured with ``torch.cuda.mem_get_info`` and the caching allocator's
    counters at the start of ``capture()`` and when it returns. The free-memory
    figure is the device's: another process allocating meanwhile, or (in the
    background) the engine's own allocations during capture, land in the items
    too (``background`` says which path measured it)."""

    free_before: NonNegative
    free_after: NonNegative
    #: free_before - free_after: what an engine must budget for the capture (negative
    #: where more was given back meanwhile than the capture took)
    drop: ByteDelta
    items: list[DeviceItem] = []
    #: no capture-plan capture ran earlier in this process: the outside-allocator
    #: item includes the driver's one-off cost of the process's first graph capture
    first_in_process: bool = False
    background: bool = False

    def item(self, name: str) -> int:
        """The bytes of the item ``name``. A KeyError naming the items there are when the
        view has none of that name (a report of another executor version): an item
        nobody measured is never read as 0."""
        for i in self.items:
            if i.name == name:
                return i.bytes
        raise KeyError(f"the device view has no item {name!r}; it has {[i.name for i in self.items]}")


class ReuseGroup(ReportStruct, frozen=True, kw_only=True):
    """Graphs of one phase that replayed through one instantiated executable."""

    phase: str
    #: the graphs (``phase/bs``), the first the one instantiated
    graphs: list[str]


class ReuseRefusal(ReportStruct, frozen=True, kw_only=True):
    """A graph of a reuse phase that shares no executable with an earlier group, and why."""

    graph: str
    reason: str


class ExecReuse(ReportStruct, frozen=True, kw_only=True):
    """What executable reuse did in a capture (phases planned with ``reuse``)."""

    #: graphs recorded in the reuse phases, and the executables instantiated for them
    graphs: NonNegative
    instantiations: NonNegative
    groups: list[ReuseGroup] = []
    refusals: list[ReuseRefusal] = []
    #: what the device's cluster probe found (``capture_plan.executor.exec_reuse.ClusterProbe``):
    #: whether a clustered kernel whose preferred cluster dimension the driver does not read
    #: back may be shared; "" where no such kernel was recorded
    clusters: str = ""


class ReportModel(ReportStruct, frozen=True, kw_only=True):
    """The model a capture ran: the plan's model dimensions (``Plan.inputs.model``), which its
    device figures (graph nodes, warm-up scratch) depend on."""

    #: dimension -> value (layers, hidden, ...), as the plan recorded them
    dimensions: dict[str, NonNegative]
    #: phase -> the dimensions its own model sets (a draft's one layer)
    phases: dict[str, dict[str, NonNegative]] = {}


class CaptureReport(ReportStruct, frozen=True, kw_only=True):
    plan: str
    plan_digest: str
    device: str
    torch: str
    backend_module: str
    pool_bytes: NonNegative
    predicted_pool_bytes: NonNegative
    capture_seconds: NonNegativeFloat
    hoisted_bytes: NonNegative = 0
    steps: list[StepMeasurement] = []
    #: the NVIDIA driver's version ("" where unknown)
    driver: str = ""
    device_view: DeviceView | None = None
    # Left out of reports that do not use them (UNSET):
    #: graphs recorded into the capture's pools outside its loop (an engine's own piecewise
    #: wrappers in its global pool), and the bytes the pools hold beyond the loop's own graphs
    outside_graphs: NonNegative | msgspec.UnsetType = msgspec.UNSET
    outside_bytes: NonNegative | msgspec.UnsetType = msgspec.UNSET
    #: bytes the warm-ups allocated and the engine kept past them (outside every pool)
    warmup_kept_bytes: NonNegative | msgspec.UnsetType = msgspec.UNSET
    #: a declared partial pass (an engine's memory-profiling pass): per phase, the graph keys
    #: it captured, into pools torn down when it ended
    profiling: dict[str, NonNegative] | msgspec.UnsetType = msgspec.UNSET
    #: what the engine measured its capture took (vLLM's ``capture_model``: the free-memory
    #: drop), set by an engine plugin that checks the plan's prediction against it
    engine_capture_bytes: ByteDelta | msgspec.UnsetType = msgspec.UNSET
    #: the plan's attention backend (``planner build --backend``) and the model it captured:
    #: what a calibration built from this report applies to (``planner build --calibration``
    #: refuses it for another backend or model); UNSET in reports written before they said
    backend: str | msgspec.UnsetType = msgspec.UNSET
    model: ReportModel | msgspec.UnsetType = msgspec.UNSET
    #: executable reuse, for a plan with a phase that decides it; UNSET elsewhere
    reuse: ExecReuse | msgspec.UnsetType = msgspec.UNSET
