"""Whether a graph file may be restored here: :func:`check_valid`, a pure function.

A restore (issue 51) rebuilds a file's graphs only where everything they were saved against
is the same: the plan (its digest), the device (name and compute capability), the driver,
torch and its CUDA, every kernel library the saving process had mapped (by digest), every
named tensor, library workspace and engine range an argument points into (present, the same
size: a range the engine owns, such as vLLM's KV cache, whose size follows the free memory,
must be sized alike in both processes), every pool an
argument points into (laid out as at save time: the same segments, the same sizes, in
address order), and no argument pointing where a restore cannot relocate (a torch segment
no named tensor covered, a device allocation outside torch's allocator, host memory).
Each difference is one line; an empty list means valid. Torch-free: the caller measures the
:class:`GraphEnvironment` (``capture_plan.executor.graph_env.current_environment``).

:func:`stale_addresses` reads the file alone: an argument word that still lies inside a
segment as the saving process had it was not relocated (the save relocates every word its
scan takes for an address, and every word inside a segment is one), so a rebuild at other
addresses would point it at the saving process's memory.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Collection
from dataclasses import dataclass, field
from itertools import accumulate

from capture_plan.schemas.graph_file import RELOCATABLE, GraphFile, Runtime

__all__ = ["GraphEnvironment", "check_valid", "segment_uses", "stale_addresses"]


# slots: a misspelt or moved field (``env.driver`` for ``env.runtime.driver``) raises instead
# of adding an attribute no check reads
@dataclass(slots=True)
class GraphEnvironment:
    """What this process offers a restore."""

    #: the plan, device, driver, torch and CUDA, as a file's ``valid_for`` records them
    runtime: Runtime
    #: kernel library file name -> "sha256:<hex>"
    libraries: dict[str, str] = field(default_factory=dict)
    #: named tensor -> its storage's bytes
    tensors: dict[str, int] = field(default_factory=dict)
    #: pool name -> its segments' bytes, in address order (the planned layout)
    pools: dict[str, list[int]] = field(default_factory=dict)
    #: library workspace ("capture/0": ``graph_env.library_workspaces``) -> its bytes
    workspaces: dict[str, int] = field(default_factory=dict)
    #: engine range (memory the engine owns outside torch's allocator, named by the caller) -> its bytes
    engine: dict[str, int] = field(default_factory=dict)


def segment_uses(file: GraphFile) -> dict[int, tuple[int, str]]:
    """Per segment index the graphs use: (how many addresses point into it, where the first
    one is: ``graph PHASE/BS node I``)."""
    counts: dict[int, int] = {}
    #: segment -> (graph index, node index, "node" or "output") of its first use
    first: dict[int, tuple[int, int, str]] = {}
    for gi, g in enumerate(file.graphs):
        for i, node in enumerate(g.nodes):
            segs = [r.segment for r in node.kernel.relocations] if node.kernel is not None else []
            if node.memset is not None:
                segs.append(node.memset.dst.segment)
            if node.copy is not None:
                segs += (node.copy.src.segment, node.copy.dst.segment)
            for seg in segs:
                n = counts.get(seg)
                if n is None:
                    counts[seg], first[seg] = 1, (gi, i, "node")
                else:
                    counts[seg] = n + 1
        for i, out in enumerate(g.outputs):
            if out.at is not None:
                seg = out.at.segment
                n = counts.get(seg)
                if n is None:
                    counts[seg], first[seg] = 1, (gi, i, "output")
                else:
                    counts[seg] = n + 1
    graphs = file.graphs
    return {
        seg: (n, f"graph {graphs[first[seg][0]].phase}/{graphs[first[seg][0]].bs} {first[seg][2]} {first[seg][1]}")
        for seg, n in counts.items()
    }


def _same(what: str, saved: str, here: str) -> list[str]:
    return [] if saved == here else [f"{what} differs: the file was saved with {saved!r}, this process has {here!r}"]


def check_valid(file: GraphFile, env: GraphEnvironment, *, later: Collection[str] = ()) -> list[str]:
    """One line per reason ``file`` cannot be restored in ``env`` (module docstring); [] if it
    can. ``later``: what the caller checks itself later: segment kinds ("workspace": a restore's
    library workspaces exist once its eager runs made them; "pool": it lays the pools out;
    "tensor"), "library" (a kernel library not mapped yet: its first use may map it; one
    mapped with another digest is refused still)."""
    v, ours = file.valid_for, env.runtime
    out = _same("plan digest", v.plan_digest, ours.plan_digest)
    out += _same(
        "device",
        f"{v.device} (compute capability {v.capability})",
        f"{ours.device} (compute capability {ours.capability})",
    )
    out += _same("driver", v.driver, ours.driver)
    out += _same("torch", f"{v.torch} (CUDA {v.cuda})", f"{ours.torch} (CUDA {ours.cuda})")
    for lib in v.libraries:
        here = env.libraries.get(lib.name)
        if here is None:
            if "library" not in later:
                out.append(
                    f"kernel library {lib.name} is not loaded in this process (the file's kernels may come from it)"
                )
        elif here != lib.digest:
            out.append(
                f"kernel library {lib.name} differs: the file was saved with {lib.digest}, this process has {here}"
            )
    uses = segment_uses(file)
    pools: dict[str, list[tuple[int, int]]] = {}
    for seg in file.segments:
        if seg.kind == "pool":
            pools.setdefault(seg.owner, []).append((seg.index, seg.size))
    for idx in sorted(uses):
        n, first = uses[idx]
        if idx >= len(file.segments):
            out.append(
                f"{first}: an address names segment {idx}, the file has {len(file.segments)}: the file is damaged"
            )
            continue
        seg = file.segments[idx]
        if seg.kind not in RELOCATABLE:
            out.append(
                f"{n} address(es) point into {seg.name} ({seg.size} B, first at {first}): {_WHY[seg.kind]} at save "
                "time, which a restore cannot relocate"
            )
        elif seg.kind in later:
            continue
        elif seg.kind in _NAMED:
            size = getattr(env, _NAMED[seg.kind][0]).get(seg.owner)
            what = _NAMED[seg.kind][1]
            if size is None:
                out.append(
                    f"{what} {seg.owner} is missing in this process ({n} address(es) point into it, first at {first})"
                    + (": the caller names it with its address (restore(engine=))" if seg.kind == "engine" else "")
                )
            elif size != seg.size:
                out.append(
                    f"{what} {seg.owner} is resized: the file was saved with {seg.size} B, this process has {size} B"
                )
    for pool, segs in sorted(pools.items()) if "pool" not in later else ():
        saved = [size for _, size in sorted(segs)]
        here = env.pools.get(pool)
        if here is None:
            out.append(f"pool {pool} is not laid out in this process (the file's graphs point into it)")
        elif here != saved:
            out.append(f"pool {pool} is laid out differently: the file has segments {saved} B, this process {here} B")
    return out


#: the kinds a restore finds by name: the environment's field that sizes them, what the refusal calls them
_NAMED = {
    "tensor": ("tensors", "tensor"),
    "workspace": ("workspaces", "library workspace"),
    "engine": ("engine", "engine memory"),
}

#: what a segment of a kind a restore cannot relocate was at save time
_WHY = {
    "torch": "a caching-allocator segment no named tensor or library workspace covered",
    "outside": "a device allocation outside every caching-allocator segment",
    "host": "host memory",
}


def stale_addresses(file: GraphFile, limit: int = 10) -> list[str]:
    """One line per kernel argument word (8 bytes, 8-byte aligned, inside one parameter, as
    the save scans them) that lies inside a segment as the saving process had it
    (``Segment.address``) and was not relocated: at most ``limit`` lines, and one more
    counting the rest. Each distinct argument block is read once (the same kernel with the
    same arguments repeats across layers and sizes)."""
    spans = sorted((s.address, s.address + s.size, s.name) for s in file.segments if s.address and s.size)
    if not spans:
        return []
    starts = [a for a, _, _ in spans]
    # segments nest (a named tensor's storage inside a caching-allocator segment saved whole as
    # torch:K): reach[j], the furthest end of the spans up to j, says whether one before j may hold a word
    reach = list(accumulate((b for _, b, _ in spans), max))
    lo, hi = spans[0][0], reach[-1]
    # argument blocks by their bytes: (parameter layout, the words found in it) per layout seen
    seen: dict[bytes, list[tuple[list, list[tuple[int, int, str]]]]] = {}
    out: list[str] = []
    count = 0
    for g in file.graphs:
        for i, node in enumerate(g.nodes):
            k = node.kernel
            if k is None:
                continue
            found = None
            same_bytes = seen.get(k.args)
            for params, got in same_bytes or ():
                if params == k.params:
                    found = got
                    break
            if found is None:
                found = []
                words = memoryview(k.args[: len(k.args) // 8 * 8]).cast("Q")
                ordered = sorted(words.tolist())
                if bisect_left(ordered, lo) < bisect_left(ordered, hi):  # some word of the block in a span's range
                    for off, size in k.params:
                        for w in range((off + 7) // 8, (off + size) // 8):
                            v = words[w]
                            if lo <= v < hi:
                                j = bisect_right(starts, v) - 1
                                while j >= 0 and v < reach[j] and v >= spans[j][1]:
                                    j -= 1  # the span starting last before v ends before it: an outer one may hold it
                                if j >= 0 and v < spans[j][1]:
                                    found.append((w * 8, v, spans[j][2]))
                seen.setdefault(k.args, []).append((k.params, found))
            for pos, v, name in found:
                count += 1
                if len(out) < limit:
                    out.append(
                        f"graph {g.phase}/{g.bs} node {i} (kernel {k.name}): the argument word at byte {pos} holds "
                        f"{v:#x}, inside {name} as saved, and is not relocated: a stale address"
                    )
    if count > limit:
        out.append(f"{count - limit} more stale argument word(s)")
    return out
