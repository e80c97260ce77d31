"""A graph file: a plan's captured CUDA graphs, written so that a fresh process could rebuild them.

Written after a capture (``capture_plan.executor.graph_file.save_graphs``: :func:`encode`),
read back by :func:`read_graph_file` for ``python -m capture_plan.executor.graph_file inspect
FILE`` and a restore (``capture_plan.executor.graph_restore``; issue 51, docs/restore.md).
Torch-free: a reader needs msgspec alone.

What it holds, per graph (keyed as the GraphSet keys it: dispatch name and size): its nodes
in the driver's order and its edges (with their port and type bytes where not all 0: PDL
edges); per kernel node its kernel (function name and the module it comes from, a
:class:`Module` identified by a digest of its functions' names), grid, block, dynamic shared
memory, the launch attributes the driver read back, the parameter layout
(``cuFuncGetParamInfo``: offset and size of each parameter) and the argument bytes with every
device address zeroed and named instead by a :class:`Relocation` (its byte position, the
segment it lies in, its offset there); memset and copy nodes likewise (their operands as
segment and offset). Segments are named by owner: ``pool:NAME/K`` the K-th segment (in
address order) of the plan's pool NAME, ``tensor:NAME`` the storage of a named tensor of the
target (its weights, KV cache, static buffers), ``workspace:STREAM/K`` the K-th block a
library keeps on one of the executor's streams outside every pool (cuBLAS's workspace on the
capture stream: ``workspace:capture/0``), ``engine:NAME`` a range of memory the engine owns
outside torch's allocator that the caller named with its address and size (vLLM's cuMem-backed
KV cache: ``graph_file.save_graphs(engine=)``; the restoring process names it again with its
address there), ``torch:K`` a caching-allocator segment none of these covers, ``outside:K`` a
device allocation outside torch's allocator, ``host:K`` host memory a copy reads or writes. A
restore can relocate into the first four kinds only; the others are recorded so that the
refusal names them (``check_valid``). Each segment keeps its
address in the saving process (:attr:`Segment.address`) for one purpose: an argument word
that still lies inside a segment as saved was not relocated, and a restore refuses it
(``graph_validity.stale_addresses``); nothing is rebuilt at those addresses.

Per graph also what a GraphSet serves it with (``capture_plan.executor.graphs.Captured``):
its pool, how its outputs are held, their rows per request, the plan's phase, labels and
piece, and each output tensor (:class:`Output`: where its first element lies as segment and
offset, its dtype, shape and strides), so that a restore re-creates the outputs over the
memory it lays out.

Per kernel function, once (:class:`Function`): the function attributes a launch depends on
as the saving process had them (what its library set before the first launch), which a
restore that fetches the kernel by name sets again.

What it is valid for (:class:`ValidFor`): the plan's digest, the device's name and compute
capability, the driver, torch and its CUDA, and the digests of the shared objects holding
kernels that the saving process had mapped (with each file's path and identity then). A
kernel's code is not in the file: see ``capture_plan.executor.graph_file``'s docstring for how a
restore gets it.

Constraints: an 8-byte word of an argument is taken for an address when the driver
resolves it (``cuMemGetAddressRange``); an integer that happens to equal a live device
address is relocated too (a false relocation is caught by a restore's replay check, not
here). A TMA descriptor (``CUtensorMap``) encodes its address: the parameters that look like
one (128 bytes, 64-byte aligned) are listed (``Kernel.tensor_maps``), not relocated.

Strict (unknown fields refused) and versioned: a file of another :data:`GRAPH_FILE_VERSION`
is refused, never read loosely.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import msgspec

from .errors import InputError
from .files import read_input

__all__ = [
    "GRAPH_FILE_KIND",
    "GRAPH_FILE_VERSION",
    "SEGMENT_KINDS",
    "RELOCATABLE",
    "Library",
    "Runtime",
    "ValidFor",
    "Segment",
    "Module",
    "Function",
    "Relocation",
    "Kernel",
    "Memset",
    "Operand",
    "Copy",
    "Node",
    "Output",
    "Graph",
    "GraphFile",
    "FileHead",
    "encode",
    "read_graph_file",
]

GRAPH_FILE_KIND = "capture-plan graph file"
#: bump when a field's meaning changes: a file of another version is refused (4: the ``engine`` segment
#: kind, which a reader of version 3 would take for a damaged file; 5: each kernel function's attributes
#: (:class:`Function`), which a restore that loads kernels by name sets, and each library's file identity)
GRAPH_FILE_VERSION = 5

#: the owners a segment may have (module docstring)
SEGMENT_KINDS = ("pool", "tensor", "workspace", "engine", "torch", "outside", "host")
#: the kinds a restore can lay out again (pools) or find again by name (the others) and relocate into
RELOCATABLE = ("pool", "tensor", "workspace", "engine")

SegmentKind = Literal["pool", "tensor", "workspace", "engine", "torch", "outside", "host"]


class _Struct(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    pass


class Library(_Struct, frozen=True, kw_only=True):
    """A shared object with kernels (a ``.nv_fatbin`` section) mapped by the saving process."""

    #: its file name (``libcublasLt.so.13``), the key a restore compares by
    name: str
    #: "sha256:<hex>" of its bytes
    digest: str
    size: int
    #: where the saving process had it mapped, and that file's identity then: (device, inode, size,
    #: modification ns, status change ns). A restore that finds the same path with the same identity
    #: takes ``digest`` for it unhashed (a replaced, rewritten or touched file changes the identity)
    path: str = ""
    stat: list[int] = []


class Runtime(_Struct, frozen=True, kw_only=True):
    """The plan and the process a file's graphs were captured with: what a restore's process
    must match, beside the kernel libraries (``check_valid`` compares each)."""

    plan_digest: str
    device: str
    #: compute capability, "9.0"
    capability: str
    driver: str
    torch: str
    #: the CUDA torch was built with
    cuda: str


class ValidFor(Runtime, frozen=True, kw_only=True):
    """What a restore must find to use the file (``check_valid`` compares each): the
    :class:`Runtime` and the kernel libraries."""

    libraries: list[Library] = []

    @property
    def runtime(self) -> Runtime:
        """The :class:`Runtime` alone, less the libraries."""
        return Runtime(**{f: getattr(self, f) for f in Runtime.__struct_fields__})


class Segment(_Struct, frozen=True, kw_only=True):
    """A piece of memory the graphs' addresses point into, named by its owner."""

    name: str
    kind: SegmentKind
    #: its bytes: a pool segment's, a tensor's storage, a workspace block's, an engine range's as
    #: the engine named it, the driver's range of an outside allocation
    size: int
    #: the pool's, tensor's, workspace's or engine range's name ("" for torch, outside and host segments)
    owner: str = ""
    #: the segment's place among its pool's segments, in address order (pool segments)
    index: int = 0
    #: where it lay in the saving process: only to find argument words left unrelocated (a
    #: restore never uses it as an address)
    address: int = 0


class Module(_Struct, frozen=True, kw_only=True):
    """A loaded module (cubin) kernels come from, identified across processes by its
    functions: ``digest`` is "sha256:<hex>" of their sorted names, one a line."""

    digest: str
    functions: int


class Function(_Struct, frozen=True, kw_only=True):
    """A kernel function as the saving process had it prepared: the attributes a launch depends
    on that a library sets before its first launch (``cuFuncGetAttribute``, by the names of
    ``capture_plan.executor.kernel_loading.FUNCTION_ATTRIBUTES``: the dynamic shared memory
    limit, the carveout, the cluster attributes). A restore that fetches a kernel by name
    (rather than by a run of its library) sets them before it adds a node of it."""

    #: index into :attr:`GraphFile.modules`
    module: int
    name: str
    #: attribute name -> its value as read back at save time (an attribute the driver did not read is absent)
    attributes: dict[str, int] = {}
    #: what the function's build fixes (``kernel_loading.FIXED_ATTRIBUTES``: registers, static,
    #: constant and local memory, its binary's version): two modules with the same function names
    #: (two builds of one Triton kernel) are told apart by them at a restore
    fixed: dict[str, int] = {}


class Relocation(_Struct, frozen=True, array_like=True):
    """An address in argument bytes: 8 bytes at ``position``, ``offset`` into segment ``segment``."""

    position: int
    segment: int
    offset: int


class Kernel(_Struct, frozen=True, kw_only=True):
    name: str
    #: index into :attr:`GraphFile.modules`
    module: int
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_bytes: int
    #: launch attributes the driver read back: name -> its three values
    attributes: dict[str, tuple[int, int, int]] = {}
    #: (offset, size) of each parameter, in order
    params: list[tuple[int, int]] = []
    #: the parameters' bytes at their offsets, every address zeroed
    args: bytes = b""
    relocations: list[Relocation] = []
    #: indexes of parameters shaped like a CUtensorMap (128 bytes, 64-byte aligned)
    tensor_maps: list[int] = []


class Operand(_Struct, frozen=True, array_like=True):
    """A memset's or copy's address as (segment index, offset)."""

    segment: int
    offset: int


class Memset(_Struct, frozen=True, kw_only=True):
    dst: Operand
    pitch: int
    value: int
    element_size: int
    width: int
    height: int


class Copy(_Struct, frozen=True, kw_only=True):
    """A 1D/2D/3D copy between addresses (arrays are refused at save time)."""

    src: Operand
    dst: Operand
    src_pitch: int
    src_height: int
    dst_pitch: int
    dst_height: int
    width: int
    height: int
    depth: int


class Node(_Struct, frozen=True, kw_only=True):
    #: the driver's node type ("kernel", "memset", "memcpy", "empty", ...)
    type: str
    kernel: Kernel | None = None
    memset: Memset | None = None
    copy: Copy | None = None


class Output(_Struct, frozen=True, kw_only=True):
    """One output tensor of a graph: where its first element lies (None for a tensor of no
    elements, which has no memory), its dtype (torch's name: "bfloat16") and its layout in
    elements."""

    at: Operand | None = None
    dtype: str
    shape: list[int]
    stride: list[int]


class Graph(_Struct, frozen=True, kw_only=True):
    #: the GraphSet's key: dispatch name and size
    phase: str
    bs: int
    nodes: list[Node]
    #: (from, to) or (from, to, from_port, to_port, type): node indexes
    edges: list[tuple[int, ...]] = []
    #: the plan's pool it was captured into
    pool: str = ""
    #: how its outputs are held: "keep" (owning) or "view" (valid until its pool's next replay)
    held: str = "keep"
    #: rows per request of each output (0: held whole); None: every output as the first
    rows: list[int] | None = None
    #: the plan's phase ("": ``phase`` itself), the key's (axis, label) pairs, the piece number
    key_phase: str = ""
    labels: list[tuple[str, str]] = []
    piece: int | None = None
    outputs: list[Output] = []


class GraphFile(_Struct, frozen=True, kw_only=True):
    kind: Literal["capture-plan graph file"] = GRAPH_FILE_KIND
    version: int = GRAPH_FILE_VERSION
    valid_for: ValidFor
    segments: list[Segment] = []
    modules: list[Module] = []
    #: every kernel function of the graphs, once, with its attributes (version 5)
    functions: list[Function] = []
    graphs: list[Graph] = []


class FileHead(msgspec.Struct, kw_only=True):
    """The two fields read before the rest: what the file is and its version (loose:
    every other field is skipped)."""

    kind: str = ""
    version: int = -1


def encode(file: GraphFile) -> bytes:
    """The file's bytes: msgpack (argument bytes stay binary)."""
    return msgspec.msgpack.encode(file)


def read_graph_file(path: str | Path) -> GraphFile:
    """A graph file, refused in one line where it is not one, of another version, or damaged."""
    data = read_input(path, "graph file")
    where = str(path)
    try:
        head = msgspec.msgpack.decode(data, type=FileHead)
    except msgspec.DecodeError as err:
        raise InputError(f"not a graph file ({err})", where=where, fix="pass a file save_graphs wrote") from None
    if head.kind != GRAPH_FILE_KIND:
        raise InputError(f"not a graph file (kind {head.kind!r})", where=where, fix="pass a file save_graphs wrote")
    if head.version != GRAPH_FILE_VERSION:
        raise InputError(
            f"graph file version {head.version}, this capture-plan reads version {GRAPH_FILE_VERSION}",
            where=where,
            fix="save the graphs again with this capture-plan",
        )
    try:
        return msgspec.msgpack.decode(data, type=GraphFile)
    except msgspec.DecodeError as err:
        raise InputError(f"a damaged graph file ({err})", where=where, fix="save the graphs again") from None
