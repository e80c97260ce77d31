"""What one capture allocates in the pool: the workload memory model.

Two sources, one output type (:class:`schemas.trace.CaptureTrace`):

* **analytic** -- derived from the spec's model dimensions: a Llama-style
  decoder step (RMSNorm with a float32 upcast, fused QKV, attention, O-proj,
  gated MLP), the final norm, bf16 logits and their float32 copy (the output),
  the backend's per-call workspace, and the cuBLAS workspace that
  ``torch.cuda.graph`` re-creates in the pool at every capture.
* **trace** -- the allocation events ``executor.profile`` recorded on a GPU.

Layers are periodic: every layer allocates and frees the same sizes in the same
order, so after the second layer the allocator is in the same state as after
the first (tests/test_workload.py checks that peaks agree with the full
count). The analytic model therefore emits at most ``LAYER_CAP`` layers, which
keeps a 1024-size plan fast. Not modelled: rotary caches, sampling, LoRA,
MoE routing, and per-rank differences beyond dividing heads and MLP by ``tp``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from schemas.errors import InputError
from schemas.spec import Model, Phase
from schemas.trace import CaptureTrace, Event, Trace

from .allocator import MiB

__all__ = ["Workload", "analytic_capture", "workspace_bytes", "LAYER_CAP", "CUBLAS_WORKSPACE"]

LAYER_CAP = 2
#: torch's cuBLAS workspace on sm90 (":4096:8" = 8 x 4 MiB), re-allocated in the
#: capturing pool at every capture_begin (the previous one is freed then).
CUBLAS_WORKSPACE = 32 * MiB


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def workspace_bytes(backend: dict, bs: int, tokens_per_request: int) -> int:
    """Bytes of the backend's per-call workspace at batch ``bs`` (0: none)."""
    ws = backend.get("workspace")
    if not ws:
        return 0
    batch = _round_up(bs, ws["round_batch_to"])
    return ws["elem_bytes"] * (ws["per_request"] * batch + ws["fixed"])


class _Events:
    def __init__(self) -> None:
        self.events: list[Event] = []
        self._next = 0

    def alloc(self, size: int, kind: str = "temp") -> int:
        i = self._next
        self._next += 1
        self.events.append(Event(op="alloc", id=i, size=size, kind=kind))
        return i

    def free(self, *ids: int) -> None:
        for i in ids:
            self.events.append(Event(op="free", id=i))


def _rmsnorm(ev: _Events, tokens: int, hidden: int, d: int) -> int:
    # x.float(); x.pow(2).mean(-1); x * rsqrt(var); .to(bf16) * weight
    x32 = ev.alloc(tokens * hidden * 4)
    sq = ev.alloc(tokens * hidden * 4)
    var = ev.alloc(tokens * 4)
    ev.free(sq)
    y32 = ev.alloc(tokens * hidden * 4)
    ev.free(x32, var)
    y = ev.alloc(tokens * hidden * d)
    ev.free(y32)
    out = ev.alloc(tokens * hidden * d)
    ev.free(y)
    return out


def analytic_capture(model: Model, phase: Phase, bs: int, backend: dict, tp: int = 1,
                     layer_cap: int = LAYER_CAP) -> CaptureTrace:
    """The allocation events of capturing ``phase`` at batch ``bs``."""
    ev = _Events()
    d = model.dtype_bytes
    tokens = bs * phase.tokens_per_request
    heads = max(1, model.heads // tp)
    kv_heads = max(1, model.kv_heads // tp)
    inter = max(1, model.intermediate // tp)
    hd = model.head_dim
    h = model.hidden
    layers = phase.layers or model.layers

    ev.alloc(CUBLAS_WORKSPACE, "library")
    ws = workspace_bytes(backend, bs, phase.tokens_per_request)
    ws_id = ev.alloc(ws, "workspace") if ws else None
    hidden = ev.alloc(tokens * h * d)  # embedding lookup
    for _ in range(min(layers, layer_cap)):
        normed = _rmsnorm(ev, tokens, h, d)
        qkv = ev.alloc(tokens * (heads + 2 * kv_heads) * hd * d)
        ev.free(normed)
        attn = ev.alloc(tokens * heads * hd * d)
        factor = backend.get("attention_temp_factor", 0.0)
        if factor:
            part = ev.alloc(int(tokens * heads * hd * factor))
            ev.free(part)
        ev.free(qkv)
        o = ev.alloc(tokens * h * d)
        ev.free(attn)
        if tp > 1:
            pass  # all-reduce is in place: no extra pool block
        res = ev.alloc(tokens * h * d)
        ev.free(o, hidden)
        normed = _rmsnorm(ev, tokens, h, d)
        gate_up = ev.alloc(tokens * 2 * inter * d)
        ev.free(normed)
        act = ev.alloc(tokens * inter * d)
        prod = ev.alloc(tokens * inter * d)
        ev.free(act, gate_up)
        down = ev.alloc(tokens * h * d)
        ev.free(prod)
        hidden = ev.alloc(tokens * h * d)
        ev.free(down, res)
    normed = _rmsnorm(ev, tokens, h, d)
    ev.free(hidden)
    rows = tokens if phase.kind in ("target_verify", "draft_extend") else bs
    logits = ev.alloc(rows * model.vocab * d)
    ev.free(normed)
    ev.alloc(rows * model.vocab * model.logits_dtype_bytes, "output")
    ev.free(logits)
    if ws_id is not None:
        ev.free(ws_id)
    return CaptureTrace(phase=phase.name, bs=bs, events=ev.events)


@dataclass(frozen=True)
class Workload:
    """Capture traces per (phase, size), from the analytic model or a recorded trace."""

    source: str  # "analytic" | "trace"
    captures: dict[tuple[str, int], CaptureTrace]

    @classmethod
    def analytic(cls, model: Model, phases: list[Phase], backend: dict, tp: int = 1) -> "Workload":
        caps = {(p.name, bs): analytic_capture(model, p, bs, backend, tp) for p in phases for bs in p.sizes}
        return cls("analytic", caps)

    @classmethod
    def from_trace(cls, trace: Trace, phases: list[Phase], source: str) -> "Workload":
        """Index a recorded trace; every planned (phase, size) must be in it."""
        names = {p.name for p in phases}
        caps: dict[tuple[str, int], CaptureTrace] = {}
        for i, cap in enumerate(trace.captures):
            where = f"{source}: $.captures[{i}]"
            if cap.phase not in names:
                raise InputError(f"unknown phase {cap.phase!r}; the spec has {sorted(names)}", where=where + ".phase")
            if (cap.phase, cap.bs) in caps:
                raise InputError(f"duplicate capture {cap.phase}/{cap.bs}", where=where)
            _check_events(cap, where)
            caps[(cap.phase, cap.bs)] = cap
        for p in phases:
            missing = [bs for bs in p.sizes if (p.name, bs) not in caps]
            if missing:
                raise InputError(f"trace has no capture for phase {p.name!r} at sizes {missing[:8]}"
                                 + (" ..." if len(missing) > 8 else ""), where=source,
                                 fix="record it again with executor.profile for this spec")
        return cls("trace", caps)

    def events(self, phase: str, bs: int) -> Iterator[Event]:
        return iter(self.captures[(phase, bs)].events)


def _check_events(cap: CaptureTrace, where: str) -> None:
    live: set[int] = set()
    seen: set[int] = set()
    for j, e in enumerate(cap.events):
        if e.op == "alloc":
            if e.id in seen:
                raise InputError(f"allocation id {e.id} reused", where=f"{where}.events[{j}]")
            seen.add(e.id)
            live.add(e.id)
        else:
            if e.id not in live:
                raise InputError(f"free of id {e.id} that is not allocated", where=f"{where}.events[{j}]")
            live.discard(e.id)
