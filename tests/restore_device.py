"""A device on which whole engine start-ups save and restore their graphs on the CPU.

What tests/test_restore.py's ``faked`` fixture fakes for one restore, for an engine's start-up
through its plugin (tests/test_plugins_restore.py): torch.cuda (tests/fake_cuda.py, the
``fake`` fixture), and a driver (:class:`EngineDriver`) on which every graph, the engine's
captured ones and a restore's loading recordings alike, walks as one graph of
tests/test_graph_file.py (a kernel, a memset, a copy, an empty node) whose addresses the test
places (:attr:`EngineDriver.place`): into a segment of the plan's pool, a tensor the plugin
names, the capture stream's cuBLAS workspace, and (``word``) whatever its struct parameter's
third word should hold (the workspace, or a range of engine memory). The rebuild, the
instantiations and the launches are recorded by the driver; every ``torch.cuda.MemPool``
tensor is tracked so that the restored pools have segments; the capture stream's workspace
is a 32 MiB segment of the fake snapshot (:func:`workspace`).
"""

from __future__ import annotations

import contextlib
import ctypes
import struct
import weakref
from types import SimpleNamespace

import torch

from test_graph_rebuild import RebuildDriver

MiB = 1 << 20


class EngineDriver(RebuildDriver):
    """The rebuild's fake driver, its graph's addresses placed by ``place()`` at every walk
    (``{"pool", "tensor", "word"}``), device ranges it resolves (``ranges``: (address, bytes)),
    launches recorded."""

    def __init__(self):
        super().__init__()
        self.place = lambda: {"pool": 0x7000_0000_0000, "tensor": 0x7100_0000_1000, "word": 0x7100_0000_2000}
        self.at: dict[str, int] = self.place()
        self.ranges: list[tuple[int, int]] = []
        self.launched: list[tuple[int, int]] = []

    def cuGraphGetNodes(self, g, arr, n):
        if arr is None:  # a walk's first call: this walk's addresses
            self.at = at = self.place()
            args = [struct.pack("<Q", at["pool"] + 0x10), struct.pack("<QQQ", at["tensor"] + 8, 7, at["word"])]
            for i, a in zip((0, 2), args):
                self.buffers[i] = ctypes.create_string_buffer(a, len(a))
                self.ptrs[i] = ctypes.addressof(self.buffers[i])
        return super().cuGraphGetNodes(g, arr, n)

    def cuGraphMemsetNodeGetParams(self, node, m):
        super().cuGraphMemsetNodeGetParams(node, m)
        m._obj.dst = self.at["pool"] + 0x20

    def cuGraphMemcpyNodeGetParams(self, node, c):
        super().cuGraphMemcpyNodeGetParams(node, c)
        c._obj.srcDevice, c._obj.dstDevice, c._obj.WidthInBytes = self.at["tensor"] + 16, self.at["pool"] + 0x30, 16

    def cuMemGetAddressRange_v2(self, base, size, value):
        for lo, n in self.ranges:
            if lo <= value.value < lo + n:
                base._obj.value, size._obj.value = lo, n
                return 0
        return 1

    def cuGraphLaunch(self, e, s):
        self.launched.append((e.value, s.value or 0))

    def kernels(self) -> list[tuple[int, ...]]:
        """The words of every rebuilt kernel's arguments: the pointer, the int, the struct's three."""
        return [
            struct.unpack("<QiiQQQ", n["args"][:40]) for n in self.nodes.values() if n["type"] == "kernel"
        ]  # fmt: skip


def install(fake, monkeypatch) -> SimpleNamespace:
    """The device (module docstring) over the ``fake`` CUDA, through ``monkeypatch``: its driver,
    the tensors made in each ``MemPool`` (``made``: pool id -> weak references)."""
    from capture_plan.executor import (
        device,
        graph_env,
        graph_file,
        graph_rebuild,
        graph_walk,
        pool,
        restore_layout,
        streams,
        tensor_map_probe,
    )
    from capture_plan.executor.errors import ExecutorError
    from fake_cuda import FakeGraph

    driver = EngineDriver()
    monkeypatch.setattr(graph_walk, "driver_calls", lambda: driver)
    monkeypatch.setattr(graph_rebuild.libcuda, "calls", lambda *names: driver)
    monkeypatch.setattr(FakeGraph, "raw_cuda_graph", lambda self: 0x1)  # every graph walks as the fake driver's

    def no_probe(calls=None):
        raise ExecutorError("no driver to encode a tensor map", where="tensor map probe")

    monkeypatch.setattr(tensor_map_probe, "probe_tensor_map", no_probe)
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0), raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA H100 80GB HBM3", raising=False)
    monkeypatch.setattr(device, "driver_version", lambda: "580.95.05")
    for module in (graph_env, graph_file):  # no library's kernels: the CPU's torch maps CUDA libraries all the same
        monkeypatch.setattr(module, "kernel_libraries", lambda maps="/proc/self/maps", only=None: [])
    monkeypatch.setattr(restore_layout, "segment_requests", lambda size: [size])  # the fake's segments: one tensor each
    monkeypatch.setattr(streams, "_primed", {})
    made = track_pool_tensors(fake, monkeypatch)
    segments = pool.pool_segments

    def pool_segments(pools):
        keys = {tuple(p) for p in pools}
        live = [r() for k, refs in made.items() if k in keys for r in refs]
        mine = [(t.data_ptr(), t.untyped_storage().nbytes()) for t in live if t is not None]
        return sorted(mine + segments([p for p in pools if tuple(p) not in made]))

    monkeypatch.setattr(pool, "pool_segments", pool_segments)
    return SimpleNamespace(driver=driver, made=made, fake=fake)


def track_pool_tensors(fake, monkeypatch) -> dict[tuple, list]:
    """Every tensor ``torch.empty`` makes inside the fake's ``use_mem_pool`` block, by the
    pool's id (weak references): what the fake's pools hold, read as their segments."""
    made: dict[tuple, list] = {}
    empty = torch.empty

    def tracked(*a, **kw):
        t = empty(*a, **kw)
        mp = getattr(fake.local, "mempool", None)
        if mp is not None:
            made.setdefault(tuple(mp.id), []).append(weakref.ref(t))
        return t

    monkeypatch.setattr(torch, "empty", tracked)
    return made


def workspace(fake, stream, address: int) -> dict:
    """cuBLAS's workspace on ``stream`` at ``address``: a 32 MiB segment of the fake snapshot
    (its dict: remove it from ``fake.segments`` for a start-up that has another)."""
    seg = {
        "address": address,
        "total_size": 32 * MiB,
        "stream": stream.cuda_stream,
        "segment_pool_id": (0, 0),
        "blocks": [{"address": address, "size": 32 * MiB, "state": "active_allocated"}],
    }
    fake.segments.append(seg)
    return seg


def pool_segment(fake, pool) -> int:
    """The address of the largest segment the fake snapshot lists in graph pool ``pool`` (the
    graph's pool addresses lie up to 0x38 bytes in: a segment of the smallest size holds 32)."""
    from capture_plan.executor.pool import pool_key

    want = pool_key(pool)
    segs = [s for s in fake.snapshot() if tuple(s.get("segment_pool_id") or ()) == want]
    return max(segs, key=lambda s: (s["total_size"], -s["address"]))["address"]


def restored_memory(dev) -> list[tuple[int, int]]:
    """(address, bytes) of every tensor the restore made in a MemPool that is alive."""
    return sorted(
        (t.data_ptr(), t.untyped_storage().nbytes())
        for refs in dev.made.values()
        for r in refs
        if (t := r()) is not None
    )
