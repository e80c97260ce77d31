"""What this process offers a graph file: its named tensors, kernel libraries, library workspaces, environment.

A graph file (``capture_plan.schemas.graph_file``) names memory by owner and says what it is
valid for; this module measures both in the process that saves a file and in the one that
restores it: :func:`named_tensors` (a target's CUDA tensors by name), :func:`graph_tensors`
(those and a GraphSet's hoisted workspaces), :func:`kernel_libraries` (the mapped shared
objects with CUDA kernels, by digest), :func:`library_workspaces` (the blocks the
executor's primed streams keep outside every pool: cuBLAS's workspace), and
:func:`current_environment`, the :class:`~capture_plan.executor.graph_validity.GraphEnvironment`
``check_valid`` compares a file with.

Constraints: the libraries are read from ``/proc/self/maps`` (Linux); each is hashed once per
process (a file's digest is kept by its identity: path, device, inode, size, modification and
status change times), and not at all by a restore that finds it as its graph file recorded it
(:func:`trust_saved_digests`).
"""

from __future__ import annotations

import hashlib
import os
import types
from collections.abc import Collection, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from capture_plan.schemas.graph_file import Library, Runtime

from .graph_validity import GraphEnvironment
from .restore_probe import stream_workspaces

__all__ = [
    "named_tensors",
    "graph_tensors",
    "kernel_libraries",
    "file_identity",
    "trust_saved_digests",
    "library_workspaces",
    "current_environment",
    "torch_versions",
]


def named_tensors(obj: object, prefix: str = "", depth: int = 4, device_type: str = "cuda") -> dict[str, object]:
    """The CUDA tensors reachable from ``obj`` by name: a module's parameters and buffers
    (``named_parameters`` and ``named_buffers``), then attributes, dict items, list and
    tuple items ``depth`` levels down (``layers.3.k_cache``). The first name found wins
    (a tensor reachable twice is named once). ``device_type``: the tensors of that device
    type instead (the CPU tests' fake CUDA keeps its tensors on the CPU)."""
    import torch

    found: dict[str, object] = {}
    seen: set[int] = set()

    def walk(x: object, name: str, left: int) -> None:
        if id(x) in seen:
            return
        seen.add(id(x))
        if isinstance(x, torch.Tensor):
            if x.device.type == device_type and x.untyped_storage().nbytes() and name not in found:
                found[name] = x
            return
        # a Python module (a target's kernel library handle) is not the target's state
        if left <= 0 or isinstance(x, (str, bytes, int, float, bool, type(None), types.ModuleType)):
            return
        if isinstance(x, torch.nn.Module):
            for n, t in [*x.named_parameters(), *x.named_buffers()]:
                walk(t, f"{name}.{n}" if name else n, 0)
        items: Iterable = ()
        if isinstance(x, Mapping):
            items = ((str(k), v) for k, v in x.items())
        elif isinstance(x, (list, tuple)):
            items = ((str(i), v) for i, v in enumerate(x))
        elif hasattr(x, "__dict__") and not isinstance(x, type):
            items = ((k, v) for k, v in vars(x).items() if not isinstance(x, torch.nn.Module) or k != "_modules")
        for k, v in items:
            walk(v, f"{name}.{k}" if name else k, left - 1)

    walk(obj, prefix, depth)
    return found


def _has_kernels(path: str) -> bool:
    """Whether the ELF file at ``path`` has a ``.nv_fatbin`` section (CUDA kernels)."""
    try:
        with open(path, "rb") as f:
            head = f.read(64)
            if head[:4] != b"\x7fELF" or head[4] != 2:  # 64-bit ELF only
                return False
            shoff = int.from_bytes(head[0x28:0x30], "little")
            shentsize = int.from_bytes(head[0x3A:0x3C], "little")
            shnum = int.from_bytes(head[0x3C:0x3E], "little")
            shstrndx = int.from_bytes(head[0x3E:0x40], "little")
            f.seek(shoff)
            table = f.read(shentsize * shnum)
            sh = table[shstrndx * shentsize : (shstrndx + 1) * shentsize]
            f.seek(int.from_bytes(sh[0x18:0x20], "little"))
            names = f.read(int.from_bytes(sh[0x20:0x28], "little"))
    except (OSError, IndexError):
        return False
    for i in range(shnum):
        off = int.from_bytes(table[i * shentsize : i * shentsize + 4], "little")
        if names[off : names.find(b"\0", off)] == b".nv_fatbin":
            return True
    return False


#: file identity (:func:`file_identity`) -> "sha256:<hex>": each library hashed once per process, and
#: not at all where a graph file carries its digest for the same identity (:func:`trust_saved_digests`)
_DIGESTS: dict[tuple[str, int, int, int, int, int], str] = {}


def file_identity(path: str) -> tuple[str, int, int, int, int, int]:
    """(path, device, inode, size, modification ns, status change ns) of the file at ``path``:
    what a replaced, rewritten or touched file changes (the status change time cannot be set
    back by its owner)."""
    st = os.stat(path)
    return (path, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _file_digest(path: str) -> tuple[tuple[str, int, int, int, int, int], str]:
    """The identity of the file at ``path`` (:func:`file_identity`) and the digest kept for it:
    a save records that identity, the one taken before the bytes were read (a file rewritten
    after its hashing must not be recorded with the new identity and the old digest)."""
    key = file_identity(path)
    if key not in _DIGESTS:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(1 << 23):
                h.update(chunk)
        _DIGESTS[key] = "sha256:" + h.hexdigest()
    return key, _DIGESTS[key]


def trust_saved_digests(libraries: Iterable[Library]) -> int:
    """Take each of ``libraries`` (a graph file's) at its saved digest where the file at its
    saved path has the identity it had when it was hashed (``Library.stat``; :func:`file_identity`)
    instead of hashing it again: a restore on the machine that saved the file hashes nothing
    (half a second of a start-up for torch's and cuBLAS's libraries). A library found
    elsewhere, or changed in any way, is hashed as before. How many were taken."""
    n = 0
    for lib in libraries:
        if not lib.path or len(lib.stat) != 5:
            continue
        try:
            key = file_identity(lib.path)
        except OSError:
            continue
        if list(key[1:]) == list(lib.stat):
            _DIGESTS[key] = lib.digest
            n += 1
    return n


def kernel_libraries(maps: str = "/proc/self/maps", only: Collection[str] | None = None) -> list[Library]:
    """The shared objects with CUDA kernels this process has mapped, by file name, with
    their digests (each file hashed once per process, several at a time) and their file
    identity (:func:`file_identity`); ``only``: those of these file names alone (a restore
    hashes the libraries its file names, not every one mapped)."""
    paths = set()
    try:
        text = Path(maps).read_text()
    except OSError:
        return []
    for line in text.splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and parts[5].startswith("/") and ".so" in parts[5]:
            path = parts[5].strip()
            if only is None or Path(path).name in only:
                paths.add(path)
    with_kernels = [p for p in sorted(paths) if _has_kernels(p)]
    # hashlib lets go of the GIL while it hashes: the libraries (GBs: torch's, cuBLAS's) in parallel
    with ThreadPoolExecutor(max_workers=min(8, len(with_kernels) or 1)) as pool:
        digests = list(pool.map(_file_digest, with_kernels))
    libs = []
    for p, (key, d) in zip(with_kernels, digests):
        libs.append(Library(name=Path(p).name, digest=d, size=key[3], path=p, stat=list(key[1:])))
    return sorted(libs, key=lambda lib: lib.name)


def library_workspaces(
    pools: Mapping[str, object], snapshot: Iterable[dict] | None = None
) -> dict[str, tuple[int, int]]:
    """The library workspaces the executor's primed streams hold outside the ``pools``
    (name -> pool handle): ``restore_probe.stream_workspaces`` over ``snapshot`` (default:
    torch's now), name -> (address, bytes)."""
    import torch

    from .pool import pool_key
    from .streams import primed_streams

    snap = torch.cuda.memory_snapshot() if snapshot is None else snapshot
    return stream_workspaces(snap, primed_streams(), {pool_key(p) for p in pools.values()})


def current_environment(
    plan_digest: str,
    tensors: Mapping[str, object],
    pools: Mapping[str, object],
    workspaces: Mapping[str, tuple[int, int]] | None = None,
    libraries: Collection[str] | None = None,
) -> GraphEnvironment:
    """This process's :class:`GraphEnvironment`: the device, driver, torch, the kernel libraries
    (``libraries``: those of these file names alone), ``tensors`` (name -> tensor) by storage
    size, ``pools`` (name -> pool handle) by their segments' sizes in address order,
    ``workspaces`` (name -> (address, bytes); default :func:`library_workspaces`) by size."""
    import torch

    from .device import driver_version
    from .pool import pool_segments

    spans = library_workspaces(pools) if workspaces is None else workspaces

    major, minor = torch.cuda.get_device_capability()
    return GraphEnvironment(
        runtime=Runtime(
            plan_digest=plan_digest,
            device=torch.cuda.get_device_name(),
            capability=f"{major}.{minor}",
            driver=driver_version(),
            torch=torch_versions()[0],
            cuda=torch_versions()[1],
        ),
        libraries={lib.name: lib.digest for lib in kernel_libraries(only=libraries)},
        tensors={n: t.untyped_storage().nbytes() for n, t in tensors.items()},  # pyright: ignore[reportAttributeAccessIssue]
        pools={n: [size for _, size in pool_segments([p])] for n, p in pools.items()},
        workspaces={n: size for n, (_, size) in spans.items()},
    )


def torch_versions() -> tuple[str, str]:
    """(torch's version, its CUDA's) as plain strings: ``torch.__version__`` is a
    ``TorchVersion``, which msgpack does not encode (every save failed on the GPU)."""
    import torch

    return str(torch.__version__), str(torch.version.cuda)


def graph_tensors(gs, target: object = None, tensors: Mapping | None = None) -> dict[str, object]:
    """The tensors a graph file names: the target's (:func:`named_tensors`), the GraphSet's
    hoisted workspaces (``workspace.PHASE``), then ``tensors`` (name -> tensor) on top."""
    named = named_tensors(target) if target is not None else {}
    named.update({f"workspace.{phase}": t for phase, t in sorted(gs.workspaces.items())})
    named.update(dict(tensors or {}))
    return named
