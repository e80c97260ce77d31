"""A restore's kernels: loaded by the target's own eager runs, found by module identity and name.

A graph file (``capture_plan.schemas.graph_file``) names each kernel by its function name and
its module's identity (``graph_walk.module_identity``). A fresh process has loaded none of
those modules (lazily loaded: a module is loaded at its first launch), and the driver lists
no process's modules, so a restore (``capture_plan.executor.graph_restore``) gets them from the
target itself: it runs the target eagerly at a few of the file's graph keys
(:func:`loading_keys`: each phase's largest size, as a capture's warm-up, then, greedily,
the key that launches the most kernels not launched yet, until every kernel of the file has
been launched once), which loads their modules as the saving process's capture did and lets
each library prepare its kernels as before any first launch (a dynamic shared memory limit,
a cluster attribute). Each of those runs is then recorded once, into a pool thrown away
after, and the graph walked (``graph_walk.walk_graph``) for its kernels' functions and
modules: the modules met, matched by identity (``graph_rebuild.module_handles``), are the
modules the rebuild looks each kernel up in by name. :func:`unlaunched_kernels` names every
kernel of the file the runs did not launch: a restore refuses them.

Constraints: a key's eager run is taken to launch the kernels its saved graph holds (the
same code at the same size, the same libraries by digest, the same device). A library whose
choice depends on anything else (an autotuner's timing, state from earlier calls) may
launch others: those not met are refused, one line each, never guessed. The runs are the
target's ``refresh`` (where the phase has a hoisted workspace) and ``run`` on the capture
stream, their temporaries in a scratch pool returned after each, as a capture's warm-ups
are; their recordings are made in the capture's error mode and never instantiated.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from capture_plan.schemas.graph_file import GraphFile

__all__ = ["file_kernels", "loading_keys", "LoadedKernels", "load_kernels", "unlaunched_kernels"]


def file_kernels(file: GraphFile) -> list[set[tuple[int, str]]]:
    """Per graph of ``file`` its kernels as (module index, name)."""
    return [{(n.kernel.module, n.kernel.name) for n in g.nodes if n.kernel is not None} for g in file.graphs]


def loading_keys(file: GraphFile) -> list[int]:
    """The graphs of ``file`` (indexes) whose keys the target runs at to launch every kernel
    of the file once (module docstring): each phase's largest size first, in the file's
    order, then the graph adding the most kernels not launched yet (the first in the file's
    order on a tie), until none adds any."""
    kernels = file_kernels(file)
    largest: dict[str, int] = {}
    for i, g in enumerate(file.graphs):
        j = largest.get(g.phase)
        if j is None or g.bs > file.graphs[j].bs:
            largest[g.phase] = i
    keys = list(largest.values())
    covered: set[tuple[int, str]] = set().union(*(kernels[i] for i in keys)) if keys else set()
    while True:
        best = max(range(len(kernels)), key=lambda i: (len(kernels[i] - covered), -i), default=None)
        if best is None or not kernels[best] - covered:
            return keys
        keys.append(best)
        covered |= kernels[best]


def unlaunched_kernels(file: GraphFile, modules: list[int | None], met: set[tuple[int, str]], ran: str) -> list[str]:
    """One line per kernel of ``file`` the loading runs (``ran``: their keys, for the line)
    did not launch: its module not met (``modules[i]`` None) or its name not met in it
    (``met``: (module handle, name) of every kernel the runs' recordings hold)."""
    out, seen = [], set()
    for g in file.graphs:
        for i, n in enumerate(g.nodes):
            k = n.kernel
            if k is None or (k.module, k.name) in seen:
                continue
            seen.add((k.module, k.name))
            handle = modules[k.module] if k.module < len(modules) else None
            if handle is None or (handle, k.name) not in met:
                why = "its module was not loaded" if handle is None else "it was not launched"
                out.append(
                    f"graph {g.phase}/{g.bs} node {i} (kernel {k.name}): {why} by the target's eager runs at {ran}, "
                    "so this process has it from no run of its library"
                )
    return out


@dataclass
class LoadedKernels:
    """What the loading runs found: per module of the file its handle here (None: not met),
    every (module handle, name) launched, the keys run ("phase/bs"), the seconds by part."""

    modules: list[int | None] = field(default_factory=list)
    met: set[tuple[int, str]] = field(default_factory=set)
    keys: list[str] = field(default_factory=list)
    parts: dict[str, float] = field(default_factory=dict)


def load_kernels(file: GraphFile, target, workspaces: Mapping[str, object], stream, device) -> LoadedKernels:
    """The target run eagerly and recorded at every key of :func:`loading_keys` (module
    docstring) on ``stream`` (the capture stream) of ``device``; ``workspaces``: the plan's
    hoisted workspaces by plan phase."""
    from .graph_rebuild import module_handles
    from .graph_walk import FunctionCache, driver_calls

    calls, cache = driver_calls(), FunctionCache()
    out = LoadedKernels(parts=dict.fromkeys(("eager", "record", "walk", "modules"), 0.0))
    loaded: list[int] = []
    for i in loading_keys(file):
        g = file.graphs[i]
        ws = workspaces.get(g.key_phase or g.phase)
        out.keys.append(f"{g.phase}/{g.bs}")
        walked = _run_and_record(target, g.phase, g.bs, ws, stream, device, calls, cache, out.parts)
        for n in walked.nodes:
            if n.kernel is not None and n.kernel.module:
                loaded.append(n.kernel.module)
                out.met.add((n.kernel.module, n.kernel.name))
    t0 = time.perf_counter()
    out.modules = module_handles(file, loaded, calls)
    out.parts["modules"] = time.perf_counter() - t0
    return out


def _run_and_record(target, name: str, bs: int, ws, stream, device, calls, cache, parts: dict):
    """The target's eager run at ``name``/``bs`` (its temporaries returned), then the same run
    recorded into a pool of its own and walked; the graph and its pool let go."""
    import torch

    from .graph_walk import walk_graph
    from .pool import scratch_pool
    from .recording import new_graph

    t0 = time.perf_counter()
    with torch.cuda.stream(stream), scratch_pool(device):
        if ws is not None:
            target.refresh(name, bs, bs, ws)
        outs = target.run(name, bs, ws)
        del outs
        stream.synchronize()  # the scratch pool's blocks are idle before it is emptied
    t1 = time.perf_counter()
    pool = torch.cuda.MemPool()
    g = new_graph()
    try:
        with torch.cuda.stream(stream):
            # a MemPool's id is a graph pool handle (torch.cuda.graph(pool=mempool.id) takes it)
            g.capture_begin(pool=pool.id, capture_error_mode="global")  # pyright: ignore[reportArgumentType]
            try:
                outs = target.run(name, bs, ws)
            except BaseException:
                try:
                    g.capture_end()
                except Exception:  # the capture is invalid already; the run's error is the one to raise
                    pass
                raise
            g.capture_end()
            del outs
        t2 = time.perf_counter()
        walked = walk_graph(g.raw_cuda_graph(), calls, where=f"loading run {name}/{bs}", cache=cache)
    finally:
        g.reset()  # before its pool goes: a graph holds its pool
    parts["eager"] += t1 - t0
    parts["record"] += t2 - t1
    parts["walk"] += time.perf_counter() - t2
    return walked
