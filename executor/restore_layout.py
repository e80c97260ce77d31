"""A restore's memory: the plan's pools laid out as a graph file's segments, owned by torch, outputs over them.

A graph file (``capture_plan.schemas.graph_file``) names every pool segment the saving
process's capture made (``pool:NAME/K``, its size) and where each graph's outputs lay in
them. A restore (``capture_plan.executor.graph_restore``) makes each plan pool a
``torch.cuda.MemPool`` of its own and cuts in it, in the file's order, one caching-allocator
segment of each saved size (:func:`segment_requests`: the tensors whose allocation makes
exactly that segment and takes all of it), and keeps those tensors: the allocator then
holds every byte of every segment as allocated, so it hands none of them to anyone (a
``MemPool`` made without ``use_on_oom`` is never another allocation's fallback either).
:func:`lay_out_pools` checks the segments it got against the file's
(:func:`layout_differences`, one line per difference). :func:`output_tensor` re-creates an
output as a view of the tensor that owns its memory here (a pool segment's, a named
tensor's), so an output keeps its memory alive as a captured graph's kept output does.

Constraints: the caching allocator's rules as torch 2.11 to 2.15 have them (no
``expandable_segments``): a request of at most 1 MiB is served from a 2 MiB segment, a
request of 1 to 10 MiB from a 20 MiB one, a larger one from a segment of its size rounded
up to 2 MiB. A saved segment of any other size is one these rules never make (a file saved
under another allocator setting): :func:`segment_requests` answers None and the restore
refuses it. An allocator configured to round otherwise (``roundup_power2_divisions``) makes
other segments, which :func:`layout_differences` names.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from capture_plan.schemas.graph_file import GraphFile, Output

from .errors import ExecutorError

__all__ = [
    "segment_requests",
    "layout_refusals",
    "layout_differences",
    "RestoredPools",
    "lay_out_pools",
    "output_bytes",
    "output_tensor",
]

#: the caching allocator's sizes (c10/cuda/CUDACachingAllocator.cpp: kSmallSize, kSmallBuffer,
#: kMinLargeAlloc, kRoundLarge)
SMALL_REQUEST, SMALL_SEGMENT, MIN_LARGE_ALLOC, ROUND_LARGE = 1 << 20, 2 << 20, 10 << 20, 2 << 20


def segment_requests(size: int) -> list[int] | None:
    """The byte sizes of the tensors whose allocation, in order, in a pool with nothing free,
    makes the caching allocator cut one segment of exactly ``size`` bytes and hand all of it
    out (module docstring); None for a size it never cuts."""
    if size == SMALL_SEGMENT:  # the small pool's only segment size: two requests of its half fill it
        return [SMALL_REQUEST, SMALL_REQUEST]
    if size >= MIN_LARGE_ALLOC and size % ROUND_LARGE == 0:  # 20 MiB (a 1-10 MiB request's) among them
        return [size]
    return None


def layout_refusals(file: GraphFile, plan_pools: Mapping[str, object]) -> list[str]:
    """One line per pool of ``file`` a restore cannot lay out for a plan whose pools are
    ``plan_pools`` (their names): a pool the plan does not have, a segment whose size the
    caching allocator never cuts, a pool whose segments are not numbered 0, 1, ..."""
    out = []
    by_pool: dict[str, list[int]] = {}
    for seg in file.segments:
        if seg.kind != "pool":
            continue
        by_pool.setdefault(seg.owner, []).append(seg.index)
        if seg.owner not in plan_pools:
            out.append(f"{seg.name} lies in pool {seg.owner}, which the plan does not have ({sorted(plan_pools)})")
        elif segment_requests(seg.size) is None:
            out.append(
                f"{seg.name} is {seg.size} B, a segment torch's caching allocator does not cut (2 MiB, or 10 MiB "
                "and more in 2 MiB steps): the file was saved under another allocator setting"
            )
    for pool, indexes in sorted(by_pool.items()):
        if sorted(indexes) != list(range(len(indexes))):
            out.append(f"pool {pool}'s segments are numbered {sorted(indexes)}: the file is damaged")
    return out


def layout_differences(pool: str, wanted: list[tuple[int, int]], got: list[tuple[int, int]]) -> list[str]:
    """One line per difference between the segments a restore asked for in ``pool``
    (``wanted``: (address of its first tensor, bytes) per saved segment, in the file's order)
    and those the pool holds (``got``: (address, bytes), any order)."""
    have = dict(got)
    out = []
    for k, (addr, size) in enumerate(wanted):
        if addr not in have:
            out.append(f"pool {pool}: segment {k} ({size} B) did not start a segment of its own here")
        elif have[addr] != size:
            out.append(f"pool {pool}: segment {k} came out {have[addr]} B, the file's is {size} B")
    extra = len(got) - len(wanted)
    if extra > 0:
        out.append(f"pool {pool}: {extra} segment(s) more than the file's {len(wanted)}")
    return out


@dataclass(eq=False)
class RestoredPools:
    """The plan's pools laid out by a restore: per pool its ``MemPool`` and handle, per pool
    the address of each saved segment here (in the file's order), and the tensors that hold
    every segment. :meth:`close` lets go of them (the segments go back to the driver at the
    next ``torch.cuda.empty_cache``, once no output view holds them)."""

    pools: dict[str, object] = field(default_factory=dict)
    handles: dict[str, tuple[int, int]] = field(default_factory=dict)
    bases: dict[str, list[int]] = field(default_factory=dict)
    #: per pool, per saved segment, the tensors that hold it
    backing: dict[str, list[list]] = field(default_factory=dict)

    def owner(self, address: int, nbytes: int):
        """The tensor holding ``nbytes`` at ``address`` whole, or None."""
        for segments in self.backing.values():
            for tensors in segments:
                for t in tensors:
                    p = t.data_ptr()
                    if p <= address and address + nbytes <= p + t.numel():
                        return t
        return None

    def close(self) -> None:
        self.backing.clear()  # the tensors before their pools: their blocks go back to each pool
        self.pools.clear()


def lay_out_pools(file: GraphFile, device, names=()) -> RestoredPools:
    """Every pool of ``file`` (and of ``names``: pools its graphs name that hold no segment)
    laid out on ``device`` (module docstring). An ExecutorError naming the first difference
    between the segments made and the file's (the pools made are let go first)."""
    import torch

    from .pool import pool_key, pool_segments

    out = RestoredPools()
    by_pool: dict[str, list[tuple[int, int]]] = {name: [] for name in names}
    for seg in file.segments:
        if seg.kind == "pool":
            by_pool.setdefault(seg.owner, []).append((seg.index, seg.size))
    try:
        for name, segs in by_pool.items():
            pool = torch.cuda.MemPool()
            out.pools[name], out.handles[name] = pool, pool_key(pool.id)
            made: list[list] = []
            with torch.cuda.use_mem_pool(pool, device=device):
                for _, size in sorted(segs):
                    requests = segment_requests(size) or []
                    made.append([torch.empty(r, dtype=torch.uint8, device=device) for r in requests])
            out.backing[name] = made
            out.bases[name] = [ts[0].data_ptr() if ts else 0 for ts in made]
            wanted = [(ts[0].data_ptr() if ts else 0, size) for ts, (_, size) in zip(made, sorted(segs))]
            lines = layout_differences(name, wanted, pool_segments([out.handles[name]]))
            if lines:
                raise ExecutorError(
                    lines[0] + (f" (and {len(lines) - 1} more)" if len(lines) > 1 else ""),
                    where="restore: the pools' layout",
                    fix="capture instead (an allocator setting, PYTORCH_CUDA_ALLOC_CONF, that differs from the saving "
                    "process's cuts other segments)",
                )
    except BaseException:
        out.close()
        raise
    return out


def output_bytes(out: Output) -> int:
    """The bytes an output spans from its first element to its last (0 without elements)."""
    import torch

    dtype = getattr(torch, out.dtype, None)
    if not isinstance(dtype, type(torch.float32)):  # a torch.dtype
        raise ExecutorError(f"an output of dtype {out.dtype!r}, which this torch does not have", where="restore")
    if not all(out.shape):
        return 0
    return (1 + sum((n - 1) * s for n, s in zip(out.shape, out.stride))) * dtype.itemsize


def output_tensor(out: Output, address: int | None, owner, device):
    """The output ``out`` re-created at ``address``: a view of ``owner`` (the tensor that holds
    its memory here whole: a pool segment's, a named tensor's), which keeps that memory as a
    captured graph's output keeps its block; where no one tensor holds it whole (an output
    across the two halves of a 2 MiB segment) ``owner`` is None and the view holds nothing
    (the restored pools hold the memory while the graphs live, as a "view" output's pool
    does); a tensor of no elements where it has none."""
    import torch

    from .pool import raw_bytes

    nbytes = output_bytes(out)
    dtype, device = getattr(torch, out.dtype), torch.device(device)
    if address is None:
        return torch.empty(0, dtype=dtype, device=device).as_strided(out.shape, out.stride)
    storage = owner.untyped_storage() if owner is not None else raw_bytes(address, nbytes, device).untyped_storage()
    base = storage.data_ptr()
    if address < base or address + nbytes > base + storage.nbytes() or (address - base) % dtype.itemsize:
        raise ExecutorError(f"an output of {nbytes} B at {address:#x} its tensor here does not hold", where="restore")
    view = torch.empty(0, dtype=dtype, device=device)
    return view.set_(storage, (address - base) // dtype.itemsize, out.shape, out.stride)
