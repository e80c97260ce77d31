"""Proving a rebuild exact: every rebuilt graph's outputs against its captured graph's, bit for bit.

Two proofs, each in the process that captured the graphs and saved their file
(``capture_plan.executor.graph_rebuild``):

* :func:`compare_replays`: the graphs rebuilt at the saving process's own addresses. Per
  graph, the captured graph is replayed twice (where the two replays differ the graph is
  ``not_repeatable``: state it updates, or kernels whose results vary, and nothing is
  compared), its outputs are filled with 0xFF, the rebuilt graph is launched on the same
  inputs (the hoisted workspace refreshed as ``GraphSet.replay`` does), and every output
  byte is compared.
* :func:`compare_moved`: the graphs rebuilt onto copies of every segment the file's
  addresses point into (pool segments, tensors, library workspaces), each copy at another
  address than its original. Per graph: the captured replay as above, then every segment
  copied, every original filled with 0xFF (so that an address the file did not relocate,
  such as one encoded in a TMA descriptor or stored in device memory, reads garbage), the
  outputs' copies filled with 0xFF, the rebuilt graph launched, its outputs read from the
  copies and compared, and the originals copied back. This proves the relocation of every
  address a graph's arguments hold; it needs twice the memory of those segments.

Constraints: both compare outputs only (what a graph writes elsewhere is not read back);
a graph without outputs compares nothing and counts as equal. Neither proves kernel loading
in a fresh process.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from capture_plan.schemas.graph_file import GraphFile

from . import libcuda
from .errors import ExecutorError
from .graph_rebuild import Rebuilt, prepare_rebuild, rebuild_graphs
from .graph_validity import segment_uses

__all__ = ["compare_replays", "compare_moved"]

#: a copy's address is aligned to this (the caching allocator's segments are aligned to more
#: than its 512-byte blocks; a kernel chosen for an aligned operand keeps its alignment)
_ALIGN = 1 << 12


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _canary(t: torch.Tensor) -> None:
    """Fill ``t`` with 0xFF bytes (NaN in a float, -1 in a signed integer)."""
    if t.numel() and t.is_contiguous():
        t.view(-1).view(torch.uint8).fill_(255)
    elif t.numel():
        t.fill_(float("nan") if t.is_floating_point() else 1)


def _reference(gs, phase: str, bs: int) -> list[torch.Tensor] | None:
    """The captured graph's outputs after a replay, as bytes, or None where a second replay
    gives others."""
    cap = gs.graphs[(phase, bs)]
    gs.replay(phase, bs)
    torch.cuda.synchronize()
    ref = [_as_bytes(t).clone() for t in cap.outputs]
    gs.replay(phase, bs)
    torch.cuda.synchronize()
    return ref if all(torch.equal(a, _as_bytes(t)) for a, t in zip(ref, cap.outputs)) else None


def _repeatable(gs, rebuilt: Rebuilt, out: dict) -> Iterator[tuple[str, int, str, list[torch.Tensor]]]:
    """Each rebuilt graph in capture order as (phase, bs, its name, its captured graph's
    outputs: :func:`_reference`); a graph whose replays differ is named in
    ``out["not_repeatable"]`` instead."""
    for phase, bs in sorted(rebuilt.execs, key=lambda key: gs.graphs[key].order):
        ref = _reference(gs, phase, bs)
        if ref is None:
            out["not_repeatable"].append(f"{phase}/{bs}")
        else:
            yield phase, bs, f"{phase}/{bs}", ref


def compare_replays(gs, rebuilt: Rebuilt) -> dict:
    """The rebuilt graphs (at the saving process's addresses) against the captured ones
    (module docstring): ``equal``, ``differ``, ``not_repeatable`` (graph names) and the
    bytes compared."""
    stream = torch.cuda.current_stream()
    out: dict = {"equal": [], "differ": [], "not_repeatable": [], "bytes_compared": 0}
    for phase, bs, name, ref in _repeatable(gs, rebuilt, out):
        cap = gs.graphs[(phase, bs)]
        for t in cap.outputs:
            _canary(t)
        gs.refresh_workspace(phase, bs, bs)
        rebuilt.launch((phase, bs), stream.cuda_stream)
        torch.cuda.synchronize()
        same = all(torch.equal(a, _as_bytes(t)) for a, t in zip(ref, cap.outputs))
        out["equal" if same else "differ"].append(name)
        out["bytes_compared"] += sum(a.numel() for a in ref)
    return out


class _Copies:
    """A copy of every segment ``file``'s addresses point into, at another address: per
    segment index (original address, copy address, bytes), and the buffers holding them."""

    def __init__(self, file: GraphFile, bases: list[int | None], device):
        calls = libcuda.calls("cuMemcpyDtoD_v2", "cuMemsetD8_v2")
        if isinstance(calls, str):
            raise ExecutorError(f"the relocation proof cannot run: {calls}", where="rebuild proof")
        self.d = calls
        self.spans: dict[int, tuple[int, int, int]] = {}
        self.buffers: list[torch.Tensor] = []
        for i in sorted(segment_uses(file)):
            base, size = bases[i], file.segments[i].size
            if base is None:  # check_valid refused such a file already
                raise ExecutorError(f"segment {file.segments[i].name} has no address here", where="rebuild proof")
            buf = torch.empty(size + _ALIGN, dtype=torch.uint8, device=device)
            self.buffers.append(buf)
            self.spans[i] = (base, (buf.data_ptr() + _ALIGN - 1) // _ALIGN * _ALIGN, size)

    def bases(self, count: int) -> list[int | None]:
        return [self.spans[i][1] if i in self.spans else None for i in range(count)]

    def _run(self, call: str, *args) -> None:
        rc = self.d[call](*args)
        if rc != 0:
            raise ExecutorError(f"{call} failed (CUresult {rc})", where="rebuild proof")

    def copy_out(self) -> None:
        """Every original to its copy, then every original filled with 0xFF."""
        torch.cuda.synchronize()
        for old, new, size in self.spans.values():
            self._run("cuMemcpyDtoD_v2", new, old, size)
        for old, _, size in self.spans.values():
            self._run("cuMemsetD8_v2", old, 0xFF, size)
        torch.cuda.synchronize()

    def copy_back(self) -> None:
        torch.cuda.synchronize()
        for old, new, size in self.spans.values():
            self._run("cuMemcpyDtoD_v2", old, new, size)
        torch.cuda.synchronize()

    def moved(self, t: torch.Tensor) -> torch.Tensor | None:
        """``t``'s elements where the copies hold them (a view of a copy's buffer), or None
        where no copied segment holds it."""
        ptr = t.data_ptr()
        span = (sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1) * t.element_size() if t.numel() else 0
        for k, (old, new, size) in enumerate(self.spans.values()):
            if old <= ptr and ptr + span <= old + size:
                buf = self.buffers[k]
                at = new + (ptr - old) - buf.data_ptr()
                return buf[at : at + span].view(t.dtype).as_strided(t.shape, t.stride())
        return None


def compare_moved(gs, path, target: object = None, walked=None, tensors=None) -> dict:
    """The graphs of the file at ``path`` rebuilt onto copies of their segments, against the
    captured ones (module docstring): ``equal``, ``differ``, ``not_repeatable`` (graph
    names), ``unreadable`` (graphs with an output in no copied segment), the bytes compared,
    the segments and bytes copied."""
    prep = prepare_rebuild(path, gs, target, walked, tensors)
    copies = _Copies(prep.file, prep.bases, gs.device)
    stream = torch.cuda.current_stream()
    moved = rebuild_graphs(prep.file, copies.bases(len(prep.file.segments)), prep.modules, stream.cuda_stream)
    out: dict = {"equal": [], "differ": [], "not_repeatable": [], "unreadable": [], "bytes_compared": 0}
    out.update(segments=len(copies.spans), bytes_copied=sum(size for _, _, size in copies.spans.values()))
    try:
        for phase, bs, name, ref in _repeatable(gs, moved, out):
            views = [copies.moved(t) for t in gs.graphs[(phase, bs)].outputs]
            if any(v is None for v in views):
                out["unreadable"].append(name)
                continue
            gs.refresh_workspace(phase, bs, bs)
            copies.copy_out()
            try:
                for v in views:
                    _canary(v)  # pyright: ignore[reportArgumentType]
                moved.launch((phase, bs), stream.cuda_stream)
                torch.cuda.synchronize()
                same = all(torch.equal(a, _as_bytes(v)) for a, v in zip(ref, views))  # pyright: ignore[reportArgumentType]
            finally:
                copies.copy_back()
            out["equal" if same else "differ"].append(name)
            out["bytes_compared"] += sum(a.numel() for a in ref)
    finally:
        moved.destroy()
    return out
