"""What one capture allocates in the pool: the workload memory model.

Two sources, one output type (:class:`schemas.trace.CaptureTrace`):

* **analytic** -- derived from the spec's model dimensions: a Llama-style
  decoder step (RMSNorm with a float32 upcast, fused QKV, attention, O-proj,
  gated MLP), the final norm, bf16 logits and their float32 copy (the output),
  the backend's per-call workspace and log-sum-exp. Measured on an H200 with
  torch 2.11, cuBLAS's workspace is not allocated in the graph pool, so the
  model has none (a recorded trace would show one as ``library`` blocks).
* **trace** -- the allocation events ``executor.profile`` recorded on a GPU.

Layers are periodic: every layer allocates and frees the same sizes in the same
order, so after the second layer the allocator is in the same state as after
the first (tests/test_workload.py checks that peaks agree with the full
count). The analytic model therefore emits at most ``LAYER_CAP`` layers, which
keeps a 1024-size plan fast. Not modelled: rotary caches, sampling, LoRA,
MoE routing, and per-rank differences beyond dividing heads and MLP by ``tp``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

from schemas.errors import InputError
from schemas.spec import Model, Phase
from schemas.trace import CaptureTrace, Event, Trace


__all__ = ["Workload", "analytic_capture", "workspace_bytes", "LAYER_CAP"]

LAYER_CAP = 2


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
    """x.float(); pow(2).mean(-1); + eps; rsqrt; x * r; .to(bf16); * weight."""
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
    out = ev.alloc(tokens * hidden * d)
    ev.free(yb, x32, var)
    return out


def _attention(ev: _Events, backend: dict, bs: int, tpr: int, heads: int, hd: int, d: int) -> int:
    """The backend call: its output, float32 log-sum-exp, per-call workspace, partials."""
    tokens = bs * tpr
    out = ev.alloc(tokens * heads * hd * d)
    lse = ev.alloc(tokens * heads * 4) if backend.get("lse", False) else None
    ws = workspace_bytes(backend, bs, tpr)
    if ws:
        ev.free(ev.alloc(ws, "workspace"))
    factor = backend.get("attention_temp_factor", 0.0)
    if factor:
        ev.free(ev.alloc(int(tokens * heads * hd * factor)))
    if lse is not None:
        ev.free(lse)
    return out


def analytic_capture(model: Model, phase: Phase, bs: int, backend: dict, tp: int = 1,
                     layer_cap: int = LAYER_CAP) -> CaptureTrace:
    """The allocation events of capturing ``phase`` at batch ``bs``.

    Mirrors a straightforward PyTorch decoder (executor/reference.py is one):
    each layer is a function whose temporaries die when it returns, in the
    order CPython releases its locals; bf16 logits, then the float32 copy that
    is returned.
    """
    ev = _Events()
    d = model.dtype_bytes
    tpr = phase.tokens_per_request
    tokens = bs * tpr
    heads = max(1, model.heads // tp)
    kv_heads = max(1, model.kv_heads // tp)
    inter = max(1, model.intermediate // tp)
    hd, h = model.head_dim, model.hidden
    layers = phase.layers or model.layers

    hidden = ev.alloc(tokens * h * d)  # embedding lookup
    for _ in range(min(layers, layer_cap)):
        x = _rmsnorm(ev, tokens, h, d)
        qkv = ev.alloc(tokens * (heads + 2 * kv_heads) * hd * d)
        attn = _attention(ev, backend, bs, tpr, heads, hd, d)
        o = ev.alloc(tokens * h * d)  # O projection; a TP all-reduce runs in place
        res = ev.alloc(tokens * h * d)
        x2 = _rmsnorm(ev, tokens, h, d)
        gate_up = ev.alloc(tokens * 2 * inter * d)
        act = ev.alloc(tokens * inter * d)
        prod = ev.alloc(tokens * inter * d)
        ev.free(act)
        down = ev.alloc(tokens * h * d)
        ev.free(prod)
        new_hidden = ev.alloc(tokens * h * d)
        ev.free(x, qkv, attn, o, res, x2, gate_up, down, hidden)  # the layer returns
        hidden = new_hidden
    x = _rmsnorm(ev, tokens, h, d)
    rows = tokens if phase.kind in ("target_verify", "draft_extend") else bs
    logits = ev.alloc(rows * model.vocab * d)
    ev.alloc(rows * model.vocab * model.logits_dtype_bytes, "output")
    ev.free(x, logits, hidden)
    return CaptureTrace(phase=phase.name, bs=bs, events=ev.events)


@dataclass(frozen=True)
class Workload:
    """Capture traces per (phase, size), from the analytic model or a recorded trace."""

    source: str  # "analytic" | "trace"
    captures: dict[tuple[str, int], CaptureTrace]
    _compiled: dict = field(default_factory=dict, repr=False, compare=False)

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

    def compiled(self, phase: str, bs: int) -> list[tuple[int, int, int, str]]:
        """Events as (size or -1 for a free, id, kind) tuples: the simulator's hot loop
        unpacks tuples much faster than it reads struct attributes."""
        key = (phase, bs)
        cached = self._compiled.get(key)
        if cached is None:
            cached = self._compiled[key] = [(e.size if e.op == "alloc" else -1, e.id, e.kind)
                                            for e in self.captures[key].events]
        return cached


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
