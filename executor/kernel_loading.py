"""A restore's kernels: modules loaded by the target's own eager runs, each kernel fetched by name.

A graph file (``capture_plan.schemas.graph_file``) names each kernel by its function name and
its module's identity (``graph_walk.module_identity``). A fresh process has loaded none of
those modules (lazily loaded: a module is loaded at its first launch), and the driver lists
no process's modules, so a restore (``capture_plan.executor.graph_restore``) gets them from the
target itself: it runs the target eagerly at a few of the file's graph keys
(:func:`loading_keys`: each phase's largest size, as a capture's warm-up, then, greedily,
the key whose graph holds kernels of the most modules not reached yet, until every module of
the file is), which loads those modules as the saving process's capture did. Each of those
runs is then recorded once, into a pool thrown away after, and the graph walked
(``graph_walk.walk_graph``) for its kernels' modules: the modules met, matched by identity
(``graph_rebuild.module_handles``), are the modules every kernel is fetched from by name
(``cuModuleGetFunction``: under lazy loading it loads that function alone), whether a run
launched it or not (:func:`fetch_functions`).

A kernel no run launched has had none of what its library does before a first launch: the
function attributes a launch depends on (:data:`FUNCTION_ATTRIBUTES`: the dynamic shared
memory limit, the carveout, the cluster attributes) are read at save time
(:func:`function_attributes`, the file's ``functions``) and set on each fetched function where
it reads otherwise, each read back, before any node is added. :func:`unloaded_kernels` names
every kernel a restore cannot have so: its module not met by the runs, its name not in its
module, an attribute that does not take. A restore refuses them.

Constraints: a key's eager run is taken to load the modules its saved graph's kernels come
from (the same code at the same size, the same libraries by digest, the same device). A
library whose choice depends on anything else (an autotuner's timing, state from earlier
calls) may reach others: a module not met is refused, one line per kernel of it, never
guessed. A library's preparation of a kernel beyond its function attributes (a function's
cache configuration, which the driver does not read back; a ``__constant__`` it writes before
a launch) is not redone for a kernel no run launched: the restore's replays against eager
runs are what proves it unneeded for the libraries measured (bench/restore_floor.py
``--fresh``). The runs are the target's ``refresh`` (where the phase has a hoisted workspace)
and ``run`` on the capture stream, their temporaries in a scratch pool returned after each, as
a capture's warm-ups are; their recordings are made in the capture's error mode and never
instantiated.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from capture_plan.schemas.graph_file import Function, GraphFile

from . import libcuda

__all__ = [
    "FUNCTION_ATTRIBUTES",
    "AT_LEAST",
    "file_modules",
    "file_functions",
    "loading_keys",
    "function_attributes",
    "FIXED_ATTRIBUTES",
    "twin_check",
    "function_refusals",
    "Fetched",
    "fetch_functions",
    "unloaded_kernels",
    "LoadedKernels",
    "load_kernels",
]

#: the function attributes a launch depends on that a library may set before a first launch and
#: ``cuFuncSetAttribute`` sets (the driver API's list of settable ``CUfunction_attribute``): name in
#: a graph file -> ``CU_FUNC_ATTRIBUTE_*``. The required cluster dimensions cannot be set where the
#: kernel was compiled with them (CUDA_ERROR_NOT_PERMITTED): such a function reads them as saved.
FUNCTION_ATTRIBUTES = {
    "max_dynamic_shared_size_bytes": 8,
    "preferred_shared_memory_carveout": 9,
    "required_cluster_width": 11,
    "required_cluster_height": 12,
    "required_cluster_depth": 13,
    "non_portable_cluster_size_allowed": 14,
    "cluster_scheduling_policy_preference": 15,
}
#: the attributes a function's build fixes (compiled in; never set): name in a graph file ->
#: ``CU_FUNC_ATTRIBUTE_*``. Two modules with the same function names (a Triton kernel built at two
#: block sizes) differ in them: a restore matches such twins by them (:func:`twin_check`)
FIXED_ATTRIBUTES = {
    "max_threads_per_block": 0,
    "shared_size_bytes": 1,
    "const_size_bytes": 2,
    "local_size_bytes": 3,
    "num_regs": 4,
    "binary_version": 6,
}
#: the attributes a function may have higher than saved and launch as saved: a library that sets the
#: dynamic shared memory limit to each launch's need leaves the last one's at save time, and a
#: restore's own runs may have raised it further (the rebuild raises it to each node's need too)
AT_LEAST = frozenset({"max_dynamic_shared_size_bytes"})


def file_modules(file: GraphFile) -> list[set[int]]:
    """Per graph of ``file`` the modules (indexes) its kernels come from."""
    return [{n.kernel.module for n in g.nodes if n.kernel is not None} for g in file.graphs]


def file_functions(file: GraphFile) -> list[Function]:
    """Every kernel function of ``file`` once, in the order first met: the file's record of it
    (its attributes) where it has one, else the function with no attribute to set."""
    saved = {(f.module, f.name): f for f in file.functions}
    out: dict[tuple[int, str], Function] = {}
    for g in file.graphs:
        for n in g.nodes:
            k = n.kernel
            if k is not None and (k.module, k.name) not in out:
                out[(k.module, k.name)] = saved.get((k.module, k.name)) or Function(module=k.module, name=k.name)
    return list(out.values())


def loading_keys(file: GraphFile) -> list[int]:
    """The graphs of ``file`` (indexes) whose keys the target runs at to load every module of
    the file (module docstring): each phase's largest size first, in the file's order, then
    the graph adding the most modules not reached yet (the first in the file's order on a
    tie), until none adds any."""
    modules = file_modules(file)
    largest: dict[str, int] = {}
    for i, g in enumerate(file.graphs):
        j = largest.get(g.phase)
        if j is None or g.bs > file.graphs[j].bs:
            largest[g.phase] = i
    keys = list(largest.values())
    covered: set[int] = set().union(*(modules[i] for i in keys)) if keys else set()
    while True:
        best = max(range(len(modules)), key=lambda i: (len(modules[i] - covered), -i), default=None)
        if best is None or not modules[best] - covered:
            return keys
        keys.append(best)
        covered |= modules[best]


def function_attributes(function: int, calls, table: Mapping[str, int] = FUNCTION_ATTRIBUTES) -> dict[str, int]:
    """``table``'s attributes (default :data:`FUNCTION_ATTRIBUTES`; :data:`FIXED_ATTRIBUTES`) of
    ``function`` (a ``CUfunction``) as the driver reads them (``cuFuncGetAttribute``; one it
    does not read is left out): what the save records."""
    out, value = {}, ctypes.c_int(0)
    f = ctypes.c_void_p(function)
    for name, aid in table.items():
        if calls["cuFuncGetAttribute"](ctypes.byref(value), aid, f) == 0:
            out[name] = value.value
    return out


def function_refusals(file: GraphFile) -> list[str]:
    """One line per function record of ``file`` a restore cannot apply: an attribute it does not
    know (a newer writer's), a module index the file lacks. From the file alone."""
    out = []
    for f in file.functions:
        unknown = sorted(set(f.attributes) - set(FUNCTION_ATTRIBUTES))
        if unknown:
            out.append(f"kernel {f.name}: function attribute(s) {unknown} this restore does not set")
        if not 0 <= f.module < len(file.modules):
            out.append(f"kernel {f.name}: module {f.module}, the file has {len(file.modules)}: the file is damaged")
    return out


@dataclass
class Fetched:
    """The kernels fetched by name: (module index, name) -> ``CUfunction``; per (module index,
    name) why it could not be (a line's tail); the attributes set, in all."""

    functions: dict[tuple[int, str], int] = field(default_factory=dict)
    missing: dict[tuple[int, str], str] = field(default_factory=dict)
    set: int = 0


def _by_name(mod: int, calls, cache: dict[int, dict[str, int]]) -> dict[str, int]:
    """Name -> function of every function of module ``mod`` (``cuFuncGetName``: the names the walk read)."""
    got = cache.get(mod)
    if got is None:
        got = cache[mod] = {}
        count, m = ctypes.c_uint(0), ctypes.c_void_p(mod)
        if calls["cuModuleGetFunctionCount"](ctypes.byref(count), m) != 0:
            return got
        funcs = (ctypes.c_void_p * count.value)()
        if calls["cuModuleEnumerateFunctions"](ctypes.cast(funcs, ctypes.c_void_p), count.value, m) != 0:
            return got
        for f in funcs:
            name = ctypes.c_char_p()
            if calls["cuFuncGetName"](ctypes.byref(name), ctypes.c_void_p(f)) == 0 and name.value:
                got.setdefault(name.value.decode(errors="replace"), f)
    return got


def _function(mod: int, name: str, calls, cache: dict[int, dict[str, int]]) -> tuple[int | None, int]:
    """Function ``name`` of module ``mod`` (``cuModuleGetFunction``; where the lookup does not
    take the name, among the module's functions by the name the walk read: :func:`_by_name`),
    None where it is in neither; and the lookup's CUresult."""
    f = ctypes.c_void_p()
    rc = calls["cuModuleGetFunction"](ctypes.byref(f), ctypes.c_void_p(mod), name.encode())
    return (f.value if rc == 0 and f.value else _by_name(mod, calls, cache).get(name)), rc


def twin_check(file: GraphFile, calls) -> Callable[[int, int], bool]:
    """Whether module ``handle`` here is the file's module ``m`` as far as the file can tell:
    each function of ``m`` the file records :data:`FIXED_ATTRIBUTES` of is in ``handle`` by name
    and reads the same. For ``graph_rebuild.module_handles``, which asks it of modules that
    share their function names only (twins); a file without the record answers True."""
    fixed: dict[int, list[Function]] = {}
    for f in file.functions:
        if f.fixed:
            fixed.setdefault(f.module, []).append(f)
    cache: dict[int, dict[str, int]] = {}

    def check(m: int, handle: int) -> bool:
        for fn in fixed.get(m, ()):
            func, _ = _function(handle, fn.name, calls, cache)
            if not func or function_attributes(func, calls, FIXED_ATTRIBUTES) != fn.fixed:
                return False
        return True

    return check


def fetch_functions(file: GraphFile, modules: list[int | None], calls=None) -> Fetched:
    """Every kernel function of ``file`` (:func:`file_functions`) fetched from its module here
    (``modules``: per module of the file its handle, None where not met) by name
    (``cuModuleGetFunction``; where the lookup does not take the name, among the module's
    functions by the name the walk read), its saved attributes set where it reads otherwise
    (``cuFuncSetAttribute``; :data:`AT_LEAST`'s where it reads less) and read back. What could
    not be fetched or set is in ``missing``."""
    from .graph_rebuild import FETCH_CALLS

    d = calls if calls is not None else libcuda.calls(*FETCH_CALLS)
    if isinstance(d, str):
        from .errors import ExecutorError

        raise ExecutorError(f"the kernels cannot be fetched: {d}", where="restore")
    out, enumerated = Fetched(), {}
    value = ctypes.c_int(0)
    for fn in file_functions(file):
        key = (fn.module, fn.name)
        mod = modules[fn.module] if 0 <= fn.module < len(modules) else None
        if mod is None:
            out.missing[key] = "its module was not loaded"
            continue
        func, rc = _function(mod, fn.name, d, enumerated)
        if not func:
            out.missing[key] = f"it is not in its module (cuModuleGetFunction: CUresult {rc})"
            continue
        f = ctypes.c_void_p(func)
        for name, want in sorted(fn.attributes.items()):
            aid = FUNCTION_ATTRIBUTES.get(name)
            if aid is None:  # function_refusals names it before any run
                continue
            least = name in AT_LEAST
            get_rc = d["cuFuncGetAttribute"](ctypes.byref(value), aid, f)
            if get_rc == 0 and (value.value >= want if least else value.value == want):
                continue
            set_rc = d["cuFuncSetAttribute"](f, aid, want)
            get_rc = d["cuFuncGetAttribute"](ctypes.byref(value), aid, f)
            if set_rc != 0 or get_rc != 0 or value.value != want:
                out.missing[key] = (
                    f"its function attribute {name} saved as {want} reads {value.value} here (set: CUresult {set_rc}, "
                    f"read: CUresult {get_rc})"
                )
                break
            out.set += 1
        else:
            out.functions[key] = func
    return out


def unloaded_kernels(file: GraphFile, missing: Mapping[tuple[int, str], str], ran: str) -> list[str]:
    """One line per kernel of ``file`` a restore does not have as saved (``missing``: (module
    index, name) -> why, :attr:`Fetched.missing`), at its first node; ``ran``: the loading
    runs' keys, for the line."""
    out, seen = [], set()
    for g in file.graphs:
        for i, n in enumerate(g.nodes):
            k = n.kernel
            if k is None or (k.module, k.name) in seen or (k.module, k.name) not in missing:
                continue
            seen.add((k.module, k.name))
            out.append(
                f"graph {g.phase}/{g.bs} node {i} (kernel {k.name}): {missing[(k.module, k.name)]} after the target's "
                f"eager runs at {ran}, so this process has it from no run of its library"
            )
    return out


@dataclass
class LoadedKernels:
    """What the loading runs found: per module of the file its handle here (None: not met),
    the kernels fetched by name (:class:`Fetched`), the keys run ("phase/bs"), the seconds by
    part (``eager``, ``record``, ``walk``: the runs, ``eager.first`` the first eager run alone;
    ``modules``: the modules matched; ``functions``: the kernels fetched and their attributes set)."""

    modules: list[int | None] = field(default_factory=list)
    fetched: Fetched = field(default_factory=Fetched)
    keys: list[str] = field(default_factory=list)
    parts: dict[str, float] = field(default_factory=dict)

    def refusals(self, file: GraphFile) -> list[str]:
        """One line per kernel of ``file`` this restore does not have (:func:`unloaded_kernels`)."""
        return unloaded_kernels(file, self.fetched.missing, ", ".join(self.keys) or "no key")


def load_kernels(file: GraphFile, target, workspaces: Mapping[str, object], stream, device) -> LoadedKernels:
    """The target run eagerly and recorded at every key of :func:`loading_keys` (module
    docstring) on ``stream`` (the capture stream) of ``device``, then, where a module of the
    file was not met, at each other key whose saved graph holds one not met yet (the most
    first) until none is left or none holds one, then every kernel of the file fetched by
    name with its attributes set (:func:`fetch_functions`); ``workspaces``: the plan's hoisted
    workspaces by plan phase."""
    from .graph_rebuild import module_handles
    from .graph_walk import FunctionCache, driver_calls

    calls, cache = driver_calls(), FunctionCache()
    out = LoadedKernels(parts=dict.fromkeys(("eager", "record", "walk", "modules", "functions"), 0.0))
    loaded: list[int] = []
    per_graph, ran = file_modules(file), set()

    def run(i: int) -> None:
        g = file.graphs[i]
        ws = workspaces.get(g.key_phase or g.phase)
        out.keys.append(f"{g.phase}/{g.bs}")
        ran.add(i)
        eager = out.parts["eager"]
        walked = _run_and_record(target, g.phase, g.bs, ws, stream, device, calls, cache, out.parts)
        out.parts.setdefault("eager.first", out.parts["eager"] - eager)  # the process's first use of its libraries
        loaded.extend(n.kernel.module for n in walked.nodes if n.kernel is not None and n.kernel.module)

    def match() -> list[int | None]:
        t0 = time.perf_counter()
        modules = module_handles(file, loaded, calls, twin_check(file, calls))
        out.parts["modules"] += time.perf_counter() - t0
        return modules

    for i in loading_keys(file):
        run(i)
    out.modules = match()
    while True:  # a module the cover's runs did not reach: the keys whose saved graphs hold it, until one does
        missing = {m for m, h in enumerate(out.modules) if h is None}
        left = [i for i in range(len(file.graphs)) if i not in ran and per_graph[i] & missing]
        if not left:
            break
        run(max(left, key=lambda i: (len(per_graph[i] & missing), -i)))
        out.modules = match()
    t0 = time.perf_counter()
    out.fetched = fetch_functions(file, out.modules)
    out.parts["functions"] = time.perf_counter() - t0
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
