"""Whether a graph file may be restored here: :func:`check_valid`, a pure function.

A restore (issue 51) rebuilds a file's graphs only where everything they were saved against
is the same: the plan (its digest), the device (name and compute capability), the driver,
torch and its CUDA, every kernel library the saving process had mapped (by digest), every
named tensor and library workspace an argument points into (present, the same size), every pool an
argument points into (laid out as at save time: the same segments, the same sizes, in
address order), and no argument pointing where a restore cannot relocate (a torch segment
no named tensor covered, a device allocation outside torch's allocator, host memory).
Each difference is one line; an empty list means valid. Torch-free: the caller measures the
:class:`GraphEnvironment` (``capture_plan.executor.graph_file.current_environment``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from capture_plan.schemas.graph_file import RELOCATABLE, GraphFile

__all__ = ["GraphEnvironment", "check_valid", "segment_uses"]


@dataclass
class GraphEnvironment:
    """What this process offers a restore."""

    plan_digest: str
    device: str
    capability: str
    driver: str
    torch: str
    cuda: str
    #: kernel library file name -> "sha256:<hex>"
    libraries: dict[str, str] = field(default_factory=dict)
    #: named tensor -> its storage's bytes
    tensors: dict[str, int] = field(default_factory=dict)
    #: pool name -> its segments' bytes, in address order (the planned layout)
    pools: dict[str, list[int]] = field(default_factory=dict)
    #: library workspace ("capture/0": ``graph_file.library_workspaces``) -> its bytes
    workspaces: dict[str, int] = field(default_factory=dict)


def segment_uses(file: GraphFile) -> dict[int, tuple[int, str]]:
    """Per segment index the graphs use: (how many addresses point into it, where the first
    one is: ``graph PHASE/BS node I``)."""
    uses: dict[int, tuple[int, str]] = {}

    def add(seg: int, where: str) -> None:
        n, first = uses.get(seg, (0, where))
        uses[seg] = (n + 1, first)

    for g in file.graphs:
        for i, node in enumerate(g.nodes):
            where = f"graph {g.phase}/{g.bs} node {i}"
            if node.kernel is not None:
                for r in node.kernel.relocations:
                    add(r.segment, where)
            if node.memset is not None:
                add(node.memset.dst.segment, where)
            if node.copy is not None:
                add(node.copy.src.segment, where)
                add(node.copy.dst.segment, where)
    return uses


def _same(what: str, saved: str, here: str) -> list[str]:
    return [] if saved == here else [f"{what} differs: the file was saved with {saved!r}, this process has {here!r}"]


def check_valid(file: GraphFile, env: GraphEnvironment) -> list[str]:
    """One line per reason ``file`` cannot be restored in ``env`` (module docstring); [] if it can."""
    v = file.valid_for
    out = _same("plan digest", v.plan_digest, env.plan_digest)
    out += _same(
        "device",
        f"{v.device} (compute capability {v.capability})",
        f"{env.device} (compute capability {env.capability})",
    )
    out += _same("driver", v.driver, env.driver)
    out += _same("torch", f"{v.torch} (CUDA {v.cuda})", f"{env.torch} (CUDA {env.cuda})")
    for lib in v.libraries:
        here = env.libraries.get(lib.name)
        if here is None:
            out.append(f"kernel library {lib.name} is not loaded in this process (the file's kernels may come from it)")
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
        elif seg.kind in ("tensor", "workspace"):
            size = (env.tensors if seg.kind == "tensor" else env.workspaces).get(seg.owner)
            what = "tensor" if seg.kind == "tensor" else "library workspace"
            if size is None:
                out.append(
                    f"{what} {seg.owner} is missing in this process ({n} address(es) point into it, first at {first})"
                )
            elif size != seg.size:
                out.append(
                    f"{what} {seg.owner} is resized: the file was saved with {seg.size} B, this process has {size} B"
                )
    for pool, segs in sorted(pools.items()):
        saved = [size for _, size in sorted(segs)]
        here = env.pools.get(pool)
        if here is None:
            out.append(f"pool {pool} is not laid out in this process (the file's graphs point into it)")
        elif here != saved:
            out.append(f"pool {pool} is laid out differently: the file has segments {saved} B, this process {here} B")
    return out


#: what a segment of a kind a restore cannot relocate was at save time
_WHY = {
    "torch": "a caching-allocator segment no named tensor or library workspace covered",
    "outside": "a device allocation outside every caching-allocator segment",
    "host": "host memory",
}
