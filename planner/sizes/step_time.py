"""Step time: what a step of ``n`` requests costs when it runs as the graph of size ``s >= n``.

Two sources, one interface (:class:`StepTime`: ``cost(n, s)`` in seconds,
``provenance``, ``source``):

* **measured** (:func:`measured_times`): the median replay seconds per
  captured size that a capture report holds (``replay_seconds``, written by
  ``capture_plan.executor.timing.time_replays``). A step padded to ``s`` costs
  the replay of ``s``: ``cost(n, s) = T(s)``. Between measured sizes ``T`` is
  linear (interpolated, approximate), below the smallest it is the smallest's,
  above the largest it continues the last two sizes' slope (extrapolated).
* **roofline** (:func:`roofline`): from the phase's model dimensions and the
  device's datasheet figures (``planner/data/devices.toml [roofline]``), three
  parts that run one after another:

  - the matrix multiplies: the longer of their weights over the memory
    bandwidth (once per layer run; for a mixture of experts, the experts ``s``
    tokens are expected to touch under uniform routing) and 2 FLOPs per weight
    per token of ``s`` over the dense BF16 peak;
  - attention: the longer of the KV cache of the ``n`` real requests at
    ``context`` tokens each over the bandwidth and its FLOPs over the peak
    (padded rows attend over almost nothing: engines give them a sequence
    length of 1);
  - activations: every tensor the step allocates at size ``s`` (the analytic
    program of planner/memory/analytic.py: the reference step's own tensors),
    written once and read once, over the bandwidth.

  Approximate: no kernel reaches a datasheet peak, fused kernels move fewer
  activations than the reference step, and launch gaps and sampling are left
  out. In the memory-bound range a padded row costs only its activations.

What neither does: model a step's time outside its graph (scheduling,
sampling on the host), or the batch's mix of sequence lengths beyond one
``context``.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from capture_plan.schemas.codec import decode_report
from capture_plan.schemas.errors import InputError
from capture_plan.schemas.files import read_input
from capture_plan.schemas.report import CaptureReport
from capture_plan.schemas.spec import Phase, phase_model

from ..inputs.build_options import SizeChoiceOptions
from ..inputs.devices import device_name, roofline_names, roofline_row
from ..inputs.resources import phase_kinds
from ..memory.analytic import analytic_program
from ..memory.program import Alloc, Program
from ..schedule.resolve import Resolved

__all__ = [
    "StepTime",
    "Measured",
    "Roofline",
    "DeviceRoofline",
    "read_timing",
    "step_times",
    "roofline_device",
    "measured_times",
    "capture_seconds",
    "roofline",
    "device_roofline",
    "device_names",
    "DEFAULT_DEVICE",
    "DEFAULT_CONTEXT",
]

#: the device a roofline is drawn for when none is named (the project's measurements are an H200's)
DEFAULT_DEVICE = "NVIDIA H200"
#: tokens of KV cache each real request reads, for a roofline
DEFAULT_CONTEXT = 1024


class StepTime:
    """``cost(n, s)``: seconds of a step of ``n`` requests run as the graph of size ``s``."""

    provenance: Literal["measured", "roofline"]
    source: str

    def cost(self, n: int, s: int) -> float:
        raise NotImplementedError

    def exact(self, s: int) -> bool:
        """Whether ``cost(., s)`` is a measured figure (not interpolated or estimated)."""
        return False


@dataclass(frozen=True)
class Measured(StepTime):
    """Median replay seconds at measured sizes of one phase, linear between them."""

    times: dict[int, float]
    source: str
    provenance: Literal["measured", "roofline"] = "measured"
    _sizes: list[int] = field(default_factory=list, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._sizes.extend(sorted(self.times))

    def at(self, s: int) -> float:
        xs, t = self._sizes, self.times
        if s in t:
            return t[s]
        if s < xs[0]:
            return t[xs[0]]
        i = bisect.bisect_left(xs, s)
        lo, hi = (xs[-2], xs[-1]) if i == len(xs) else (xs[i - 1], xs[i])
        slope = (t[hi] - t[lo]) / (hi - lo)
        if i == len(xs):  # past the largest: the last slope, never falling
            return t[hi] + max(0.0, slope) * (s - hi)
        return t[lo] + slope * (s - lo)

    def cost(self, n: int, s: int) -> float:
        return self.at(s)

    def exact(self, s: int) -> bool:
        return s in self.times


def read_timing(path: Path) -> tuple[CaptureReport, str]:
    """The capture report at ``path`` (``--timing``), and the path as shown."""
    shown = str(path)
    raw = read_input(
        path, "report", fix="give a capture report written after capture_plan.executor.timing.time_replays"
    )
    return decode_report(raw, shown), shown


def _per_phase(rep: CaptureReport, field_: str, op: str = "capture") -> dict[str, dict[int, float]]:
    out: dict[str, dict[int, float]] = {}
    for m in rep.steps:
        kind, _, rest = m.id.partition("/")
        phase, _, bs = rest.rpartition("/")
        value = getattr(m, field_)
        if kind == op and bs.isdigit() and isinstance(value, (int, float)):
            out.setdefault(phase, {})[int(bs)] = float(value)
    return out


def measured_times(rep: CaptureReport, shown: str, phase: str) -> Measured:
    """The replay times ``rep`` measured for ``phase``; refused when it timed fewer than two sizes of it."""
    times = _per_phase(rep, "replay_seconds").get(phase, {})
    if len(times) < 2:
        raise InputError(
            f"the report times {len(times)} size(s) of phase {phase!r}; the step time needs two or more",
            where=f"{shown}: $.steps",
            fix="capture the plan, call capture_plan.executor.timing.time_replays(graphs) and write_report, "
            "or leave out --timing for a roofline",
        )
    return Measured(times=dict(sorted(times.items())), source=f"{shown} ({rep.device}): {len(times)} sizes replayed")


def capture_seconds(rep: CaptureReport, phase: str) -> dict[int, float]:
    """Seconds each capture step of ``phase`` took in ``rep`` (warm-ups not included), per size."""
    return _per_phase(rep, "seconds").get(phase, {})


@dataclass(frozen=True)
class DeviceRoofline:
    """A device's datasheet figures (``planner/data/devices.toml [roofline]``)."""

    name: str
    #: bytes per second
    memory_bandwidth: float
    #: dense BF16 FLOPs per second
    bf16_flops: float
    source: str


def device_names() -> list[str]:
    """The devices with roofline figures (planner/inputs/devices.py ``roofline_names``)."""
    return roofline_names()


def device_roofline(name: str) -> DeviceRoofline:
    """The roofline figures of device ``name``, as ``--device`` names it
    (planner/inputs/devices.py ``device_name``: a name no table knows, or a device without
    figures, is its :class:`~capture_plan.planner.inputs.devices.DeviceRefused`)."""
    key = device_name(name, ("roofline",))
    row = roofline_row(key)
    assert row is not None, "device_name gives a device with roofline figures"
    return DeviceRoofline(
        name=key,
        memory_bandwidth=float(row["memory_bandwidth"]),
        bf16_flops=float(row["bf16_flops"]),
        source=str(row["source"]),
    )


@dataclass(frozen=True)
class Roofline(StepTime):
    """The longer of bytes over bandwidth and FLOPs over peak, per step (per tensor-parallel rank)."""

    device: DeviceRoofline
    #: bytes of the weights read once per repetition, besides the routed experts
    dense_bytes: float
    #: per routed expert: its weight bytes (0: no experts)
    expert_bytes: float
    experts: int
    experts_per_token: int
    #: weight elements a token multiplies (dense and its experts): FLOPs are twice this per token
    params_per_token: float
    #: KV-cache bytes one real request reads per repetition
    kv_bytes_per_request: float
    #: attention FLOPs of one real token per repetition
    attention_flops_per_token: float
    #: rows a batch of one request runs (tokens_per_request, or topk for draft steps)
    rows_per_request: int
    #: repetitions of the whole (a draft_decode graph runs ``steps`` draft steps)
    repeats: int
    #: bytes every tensor of the step at a size allocates (written once, read once: twice this moves)
    activation_bytes: Callable[[int], int]
    source: str
    provenance: Literal["measured", "roofline"] = "roofline"

    def cost(self, n: int, s: int) -> float:
        bw, peak = self.device.memory_bandwidth, self.device.bf16_flops
        rows = s * self.rows_per_request
        touched = 0.0
        if self.experts:
            # expected experts touched by `rows` tokens routed uniformly to experts_per_token of them
            touched = self.experts * (1.0 - (1.0 - self.experts_per_token / self.experts) ** rows)
        weights = (self.dense_bytes + touched * self.expert_bytes) / bw
        gemm = max(weights, 2.0 * self.params_per_token * rows / peak)
        real = n * self.rows_per_request
        attention = max(n * self.kv_bytes_per_request / bw, real * self.attention_flops_per_token / peak)
        return self.repeats * (gemm + attention) + 2.0 * self.activation_bytes(s) / bw


def step_times(
    r: Resolved, opts: SizeChoiceOptions, timing: tuple[CaptureReport, str] | None, names: list[str]
) -> dict[str, StepTime]:
    """The step time per size of each phase of ``r`` that ``names`` names: measured
    (``timing``: a report with replay times and how to name it, :func:`read_timing`), else the
    roofline of ``r``'s model on :func:`roofline_device`'s device and ``opts``' context
    (bounded by the model's window: ``opts`` as the size choice resolved them)."""
    if timing is not None:
        rep, shown = timing
        return {n: measured_times(rep, shown, n) for n in names}
    assert opts.context is not None, "the size choice resolves it"
    # a --device without roofline figures never reaches here: the build refused it (build_device)
    device = device_roofline(roofline_device(r))
    return {n: roofline(r, r.by_name[n], device, opts.context) for n in names}


def roofline_device(r: Resolved) -> str:
    """The device whose roofline prices a step of the build ``r``: ``--device``, else its
    calibration's (a list's device total is that device's: its step times are then of the same
    one), else :data:`DEFAULT_DEVICE`. ``--device`` naming another device than the calibration
    was measured on never reaches here: resolving the build refused it
    (planner/schedule/read.py ``device_estimate``; tests/test_sizes.py
    ``test_a_calibration_is_priced_with_its_own_devices_roofline``)."""
    device, calibration, calibration_path = r.opts.device, r.calibration, r.opts.calibration
    if calibration is None:  # not `or`: --device '' is a device no table has, refused (it priced the H200)
        return DEFAULT_DEVICE if device is None else device
    measured = calibration.device.split(" sm")[0].strip()
    if device is None:
        if measured not in device_names():
            raise InputError(
                f"no roofline figures for {measured!r}, the device the calibration was measured on",
                where=f"--calibration {calibration_path}",
                fix="measure step times on it with --timing REPORT, or add it to planner/data/devices.toml [roofline]",
            )
        return measured
    named = device_roofline(device).name
    assert named == measured, "read.device_estimate refuses a --device other than the calibration's"
    return named


def _allocated(program: Program) -> int:
    """Bytes a program allocates in all: what the step writes."""

    def total(ops) -> int:
        return sum(op.size for op in ops if isinstance(op, Alloc))

    return total(program.prologue) + program.repeats * total(program.body) + total(program.epilogue)


def roofline(r: Resolved, phase: Phase, device: DeviceRoofline, context: int) -> Roofline:
    """The roofline of ``phase`` of the build ``r`` (its model, or the phase's own dimensions
    where it has them) on ``device``, per rank of ``r``'s tp, each real request attending over
    ``context`` tokens; its activations are those of the analytic program with ``r``'s
    backend's attention."""
    model, tp, backend = r.spec.model, r.tp, r.backend
    m = phase_model(model, phase)
    kind = phase_kinds()[phase.kind]  # its properties: planner/data/phase_kinds.toml
    heads, kv = max(1, m.heads // tp), max(1, m.kv_heads // tp)
    layers = phase.layers or m.layers
    attn = m.hidden * (heads + 2 * kv) * m.head_dim + heads * m.head_dim * m.hidden
    experts = m.experts if isinstance(m.experts, int) else 0
    k = m.experts_per_token if isinstance(m.experts_per_token, int) else 0
    if experts:
        width = m.expert_intermediate if isinstance(m.expert_intermediate, int) else m.intermediate
        shared = m.shared_expert_intermediate if isinstance(m.shared_expert_intermediate, int) else 0
        dense_mlp, expert = 3 * m.hidden * shared // tp, 3 * m.hidden * width // tp
        per_token_mlp = dense_mlp + k * expert
    else:
        dense_mlp, expert = 3 * m.hidden * m.intermediate // tp, 0
        per_token_mlp = dense_mlp
    # vLLM's graphs (hidden, piecewise) end at the final norm: the logits are outside them
    head = m.vocab * m.hidden // tp if kind.lm_head else 0
    d = m.dtype_bytes
    rows = phase.topk if kind.rows_per_request == "topk" else phase.tokens_per_request
    repeats = phase.steps if "steps" in kind.settings else 1  # a draft's tree steps, in one graph
    return Roofline(
        device=device,
        dense_bytes=float(d * (layers * (attn + dense_mlp) + head)),
        expert_bytes=float(d * layers * expert),
        experts=experts,
        experts_per_token=k,
        params_per_token=float(layers * (attn + per_token_mlp) + head),
        kv_bytes_per_request=float(context * layers * 2 * kv * m.head_dim * d),
        attention_flops_per_token=float(4 * context * heads * m.head_dim * layers),
        rows_per_request=rows,
        repeats=repeats,
        activation_bytes=functools.cache(lambda s: _allocated(analytic_program(model, phase, s, backend, tp))),
        source=f"roofline of {device.name} ({device.source}: {device.memory_bandwidth / 1e12:g} TB/s, "
        f"{device.bf16_flops / 1e12:g} TFLOPS BF16), context {context} tokens, tp {tp}: approximate",
    )
