"""The compiled graph builder (executor/_graph_build.pyx) against the ctypes path, the reference.

A fake driver of C-callable functions (ctypes callbacks: each has a C address, as libcuda's
entry points do) records every call a rebuild makes and every byte each call was handed: the
parameter structures whole, the argument bytes behind every kernel parameter pointer, the
edges' node handles and data, the launch attributes' 64-byte values. Both builders rebuild the
same files (the fake graph of tests/test_graph_file.py and random files of many kernels,
memsets, copies, empty nodes, launch attributes and edges); the node-adding calls must be the
same calls with the same bytes, and the kernels' look-ups the same calls in the same order
(the compiled path makes them while flattening a graph, before its first node: graph_flat's
docstring). Every failure the ctypes path names, the compiled path names alike. The structures
the extension declares are checked against executor/libcuda.py's ctypes ones."""

from __future__ import annotations

import ctypes
import random
import re
import struct

import msgspec
import pytest

pytest.importorskip("torch")  # the executor imports torch

from capture_plan.executor import ExecutorError, graph_flat
from capture_plan.executor.exec_update import ATTRIBUTES
from capture_plan.executor.graph_rebuild import REBUILD_CALLS, rebuild_graphs
from capture_plan.executor.libcuda import SIGNATURES, EdgeData, KernelParams, Memcpy3D, MemsetParams
from capture_plan.schemas.graph_file import Copy, GraphFile, Kernel, Memset, Node, Operand, Relocation
from test_graph_rebuild import BASES, RebuildDriver, _plain_file

try:
    from capture_plan.executor import _graph_build
except ImportError:  # not built here: the comparisons skip, test_the_compiled_graph_builder_is_built says why
    _graph_build = None

needs_compiled = pytest.mark.skipif(_graph_build is None, reason="the compiled graph builder is not built here")

MODULE = 0x300
#: the fake module's kernels: name -> (function, parameter (offset, size)s); "late" is found only
#: among the module's functions (cuModuleGetFunction misses it, as it misses some mangled names)
KERNELS = {
    "gemm_kernel": (0x1000, [(0, 8), (8, 4), (16, 24)]),
    "rms_kernel": (0x1010, [(0, 8), (8, 8), (16, 4), (24, 8)]),
    "no_params": (0x1020, []),
    "big_struct": (0x1030, [(0, 128), (128, 8)]),
    "late": (0x1040, [(0, 16)]),
}
FUNCS = {f: layout for f, layout in KERNELS.values()}
NAMES = {f: name.encode() for name, (f, _) in KERNELS.items()}
#: the calls that look a kernel up (as the fake logs them): the compiled path makes them while flattening
LOOKUPS = {"get function", "count", "enumerate", "name", "func get", "func set"}


class CDriver(dict):
    """Every rebuild call as a C-callable function, recording what it was handed. A launch
    attribute reads back what was set on the node, else its function's default (``defaults``:
    (function, attribute id) -> (CUresult, three words); (0, (0, 0, 0)) where not named);
    ``ignore_set``: functions whose attributes the driver does not keep; ``rc``: per call, the
    CUresult of its Nth call (1-based) or of every call (N 0)."""

    def __init__(self, defaults=None, ignore_set=(), rc=None):
        super().__init__()
        self.defaults = defaults or {}
        self.ignore_set, self.rc = set(ignore_set), rc or {}
        self.log: list[tuple] = []
        self.errors: list[str] = []
        self.count: dict[str, int] = {}
        self.handles = 0x5000
        self.attrs: dict[tuple[int, int], tuple[int, int, int]] = {}
        self.node_func: dict[int, int] = {}
        self._names = {f: ctypes.c_char_p(n) for f, n in NAMES.items()}
        self._keep = []
        for name in REBUILD_CALLS:
            fn = ctypes.CFUNCTYPE(ctypes.c_int, *SIGNATURES[name])(self._wrap(name, getattr(self, name)))
            self._keep.append(fn)
            self[name] = fn

    def _wrap(self, name, fn):
        def call(*args):
            n = self.count[name] = self.count.get(name, 0) + 1
            want = self.rc.get(name)
            if want is not None and want[0] in (0, n):
                self.log.append((name, "failed", want[1]))
                return want[1]
            try:
                return fn(*args) or 0
            except Exception as e:  # a callback's exception is lost in C: kept, the test fails on it
                self.errors.append(f"{name}: {e!r}")
                return 999

        return call

    def _handle(self) -> int:
        self.handles += 1
        return self.handles

    def cuCtxGetCurrent(self, out):
        out[0] = 0xC7

    def cuGraphCreate(self, out, flags):
        out[0] = self._handle()
        self.log.append(("create", out[0], flags))

    def cuModuleGetFunction(self, out, mod, name):
        self.log.append(("get function", mod, name))
        if mod != MODULE or name == b"late":
            return 500
        out[0] = KERNELS[name.decode()][0]

    def cuModuleGetFunctionCount(self, out, mod):
        self.log.append(("count", mod))
        out[0] = len(FUNCS)

    def cuModuleEnumerateFunctions(self, funcs, n, mod):
        self.log.append(("enumerate", n, mod))
        arr = (ctypes.c_void_p * n).from_address(funcs)
        for i, f in enumerate(FUNCS):
            arr[i] = f

    def cuFuncGetName(self, out, func):
        self.log.append(("name", func))
        out[0] = self._names[func].value

    def cuFuncGetAttribute(self, out, attr, func):
        self.log.append(("func get", attr, func))
        out[0] = 48 << 10

    def cuFuncSetAttribute(self, func, attr, value):
        self.log.append(("func set", func, attr, value))

    def cuGraphAddKernelNode_v2(self, out, graph, deps, n, p):
        raw = bytearray(ctypes.string_at(p, ctypes.sizeof(KernelParams)))
        c = p.contents
        kp = c.kernelParams
        raw[KernelParams.kernelParams.offset : KernelParams.kernelParams.offset + 8] = bytes(8)
        layout = FUNCS[c.func]
        args = None
        if kp:
            ptrs = (ctypes.c_void_p * len(layout)).from_address(kp)
            first = ptrs[0] - layout[0][0] if layout else 0
            # each parameter where its offset says, the buffer 64-byte aligned, and its bytes
            args = [(ptrs[i] - first, ctypes.string_at(ptrs[i], size)) for i, (_, size) in enumerate(layout)]
            args.append(("aligned", first % 64 == 0))
        out[0] = self._handle()
        self.node_func[out[0]] = c.func
        self.log.append(("kernel", out[0], graph, deps, n, bytes(raw), args))

    def cuGraphKernelNodeGetAttribute(self, node, aid, buf):
        got = self.attrs.get((node, aid))
        rc, value = (0, got) if got is not None else self.defaults.get((self.node_func[node], aid), (0, (0, 0, 0)))
        words = (ctypes.c_uint * 16).from_address(buf)
        self.log.append(("get", node, aid, bytes(words)))  # what the caller handed: zeros
        words[0], words[1], words[2] = value
        return rc

    def cuGraphKernelNodeSetAttribute(self, node, aid, val):
        words = (ctypes.c_uint * 16).from_address(val)
        self.log.append(("set", node, aid, bytes(words)))
        if self.node_func[node] not in self.ignore_set:
            self.attrs[(node, aid)] = (words[0], words[1], words[2])

    def cuGraphAddMemsetNode(self, out, graph, deps, n, p, ctx):
        out[0] = self._handle()
        self.log.append(("memset", out[0], graph, deps, n, ctypes.string_at(p, ctypes.sizeof(MemsetParams)), ctx))

    def cuGraphAddMemcpyNode(self, out, graph, deps, n, p, ctx):
        out[0] = self._handle()
        self.log.append(("memcpy", out[0], graph, deps, n, ctypes.string_at(p, ctypes.sizeof(Memcpy3D)), ctx))

    def cuGraphAddEmptyNode(self, out, graph, deps, n):
        out[0] = self._handle()
        self.log.append(("empty", out[0], graph, deps, n))

    def cuGraphAddDependencies_v2(self, graph, src, dst, data, n):
        s, d = (list((ctypes.c_void_p * n).from_address(a)) for a in (src, dst))
        self.log.append(("edges", graph, s, d, ctypes.string_at(data, n * ctypes.sizeof(EdgeData)), n))

    def cuGraphInstantiateWithFlags(self, out, graph, flags):
        out[0] = self._handle()
        self.log.append(("instantiate", graph, flags))

    def cuGraphUpload(self, e, s):
        self.log.append(("upload", e, s))

    def cuGraphLaunch(self, e, s):
        self.log.append(("launch", e, s))

    def cuStreamSynchronize(self, s):
        self.log.append(("sync", s))

    def cuGraphExecDestroy(self, e):
        self.log.append(("exec destroy", e))

    def cuGraphDestroy(self, g):
        self.log.append(("destroy", g))


def _kernel(rng: random.Random, name: str) -> Kernel:
    _, layout = KERNELS[name]
    n = max((off + size for off, size in layout), default=0) + rng.choice([0, 0, 8])
    args = bytes(rng.getrandbits(8) for _ in range(n))
    words = [off + w for off, size in layout for w in range(0, size - 7, 8)]  # 8-byte words inside parameters
    relocs = [
        Relocation(position=p, segment=rng.randrange(3), offset=rng.randrange(1 << 20))
        for p in sorted(rng.sample(words, min(len(words), rng.randint(0, 3))))
    ]
    attrs = {}
    for attr in rng.sample(sorted(ATTRIBUTES), rng.randint(0, 3)):
        attrs[attr] = rng.choice([(0, 0, 0), (1, 1, 1), (2, 1, 1), (rng.randrange(8), 0, 0)])
    return Kernel(
        name=name,
        module=0,
        grid=(rng.randint(1, 1 << 16), rng.randint(1, 4), 1),
        block=(rng.choice([32, 128, 256, 1024]), 1, 1),
        shared_bytes=rng.choice([0, 4096, 48 << 10, 64 << 10, 200 << 10]),
        attributes=attrs,
        params=list(layout),
        args=args,
        relocations=relocs,
    )


def _op(rng: random.Random) -> Operand:
    return Operand(segment=rng.randrange(3), offset=rng.randrange(1 << 20))


def _random_file(seed: int) -> GraphFile:
    """The fake graph's file with random graphs of its segments and module in place of its graph."""
    rng = random.Random(seed)
    base = _plain_file()
    graphs = []
    for gi in range(rng.randint(1, 4)):
        nodes = []
        for _ in range(rng.randint(1, 50)):
            r = rng.random()
            if r < 0.7:
                nodes.append(Node(type="kernel", kernel=_kernel(rng, rng.choice(sorted(KERNELS)))))
            elif r < 0.82:
                m = Memset(dst=_op(rng), pitch=0, value=rng.getrandbits(32), element_size=rng.choice([1, 2, 4]),
                           width=rng.randrange(1, 4096), height=1)  # fmt: skip
                nodes.append(Node(type="memset", memset=m))
            elif r < 0.92:
                pitches = {"src_pitch": rng.randrange(4096), "dst_pitch": rng.randrange(4096)}
                extent = {"width": rng.randrange(1, 4096), "height": 1, "depth": 1}
                c = Copy(src=_op(rng), dst=_op(rng), src_height=1, dst_height=1, **pitches, **extent)
                nodes.append(Node(type="memcpy", copy=c))
            else:
                nodes.append(Node(type="empty"))
        n = len(nodes)
        edges: list[tuple[int, ...]] = []
        for _ in range(rng.randint(0, 2 * n)):
            a, b = sorted(rng.sample(range(n), 2)) if n > 1 else (0, 0)
            if a != b:
                edges.append(
                    (a, b, rng.randrange(3), rng.randrange(2), rng.randrange(3)) if rng.random() < 0.2 else (a, b)
                )
        graphs.append(msgspec.structs.replace(base.graphs[0], bs=gi + 1, nodes=nodes, edges=edges))
    return msgspec.structs.replace(base, graphs=graphs)


#: what new nodes of each function read back before anything is set: some a cluster of 1, one an error
DEFAULTS = {
    (0x1000, ATTRIBUTES["cluster_dimension"]): (0, (1, 1, 1)),
    (0x1010, ATTRIBUTES["cluster_dimension"]): (0, (2, 1, 1)),
    (0x1030, ATTRIBUTES["preferred_cluster_dimension"]): (1, (0, 0, 0)),
}


def _run(builder: str, file: GraphFile, monkeypatch, bases=BASES, **kw):
    """``file`` rebuilt on a fresh CDriver by ``builder``: (the driver, the Rebuilt or the error)."""
    monkeypatch.setenv(graph_flat.BUILDER_ENV, builder)
    d = CDriver(defaults=DEFAULTS, **kw)
    try:
        out = rebuild_graphs(file, bases, [MODULE], 0x5, d)
    except ExecutorError as e:
        out = e
    assert d.errors == []
    return d, out


def _same_calls(a: CDriver, b: CDriver) -> None:
    """The same node-adding calls with the same bytes in the same order, and the same look-ups."""
    adds = [x for x in a.log if x[0] not in LOOKUPS], [x for x in b.log if x[0] not in LOOKUPS]
    looks = [x for x in a.log if x[0] in LOOKUPS], [x for x in b.log if x[0] in LOOKUPS]
    for i, (x, y) in enumerate(zip(*adds)):
        assert x == y, f"call {i} differs: ctypes {x} != compiled {y}"
    assert len(adds[0]) == len(adds[1]) and looks[0] == looks[1]


@needs_compiled
@pytest.mark.parametrize("seed", range(12))
def test_both_builders_make_the_same_calls_with_the_same_bytes(seed, monkeypatch):
    f = _random_file(seed)
    a, ra = _run("ctypes", f, monkeypatch)
    b, rb = _run("compiled", f, monkeypatch)
    assert not isinstance(ra, Exception) and not isinstance(rb, Exception), (ra, rb)
    assert (ra.builder, rb.builder) == ("ctypes (CAPTURE_PLAN_GRAPH_BUILDER=ctypes)", "compiled")
    assert ra.nodes == rb.nodes == sum(len(g.nodes) for g in f.graphs)
    assert list(ra.execs.values()) == list(rb.execs.values())
    _same_calls(a, b)
    kinds = {x[0] for x in a.log}
    assert {"kernel", "create", "instantiate"} <= kinds


@needs_compiled
def test_the_random_files_reach_every_path_of_the_builder(monkeypatch):
    """Every kind of node and call, attributes set and read back, an edge with data, a
    kernel without parameters, one found only among its module's functions."""
    seen: set = set()
    for seed in range(12):
        d, out = _run("compiled", _random_file(seed), monkeypatch)
        assert not isinstance(out, Exception)
        seen |= {x[0] for x in d.log}
        seen |= {"no params" for x in d.log if x[0] == "kernel" and x[-1] is None}
        seen |= {"edge data" for x in d.log if x[0] == "edges" and any(x[4])}
    want = {"kernel", "memset", "memcpy", "empty", "edges", "get", "set", "enumerate", "func set", "no params"}
    assert want | {"edge data"} <= seen, want - seen


@needs_compiled
def test_the_fake_graph_is_rebuilt_alike_by_both(monkeypatch):
    """tests/test_graph_rebuild.py's graph: the kernel's patched arguments, the cluster dimension
    set and read back, the memset's and copy's relocated operands, the PDL edge's data."""
    f = _plain_file()
    a, ra = _run("ctypes", f, monkeypatch)
    b, rb = _run("compiled", f, monkeypatch)
    assert not isinstance(rb, Exception)
    _same_calls(a, b)
    (kernel,) = [x for x in b.log if x[0] == "kernel"]
    assert struct.unpack_from("<Q", kernel[-1][0][1])[0] == BASES[0] + 0x40
    assert [x[0] for x in b.log if x[0] in ("get", "set")] == ["get", "set", "get"]


# -- every failure named alike ------------------------------------------------------------------


def _failure(builder: str, file: GraphFile, monkeypatch, **kw) -> tuple[str, list]:
    d, out = _run(builder, file, monkeypatch, **kw)
    assert isinstance(out, ExecutorError), out
    return str(out), [x for x in d.log if x[0] in ("create", "destroy", "exec destroy")]


@needs_compiled
@pytest.mark.parametrize(
    "kw, said",
    [
        ({"rc": {"cuGraphAddKernelNode_v2": (3, 700)}}, r"node \d+: cuGraphAddKernelNode_v2 failed \(CUresult 700\)"),
        ({"rc": {"cuGraphAddMemsetNode": (1, 701)}}, r"node \d+: cuGraphAddMemsetNode failed \(CUresult 701\)"),
        ({"rc": {"cuGraphAddMemcpyNode": (2, 702)}}, r"node \d+: cuGraphAddMemcpyNode failed \(CUresult 702\)"),
        ({"rc": {"cuGraphAddEmptyNode": (1, 703)}}, r"node \d+: cuGraphAddEmptyNode failed \(CUresult 703\)"),
        ({"rc": {"cuGraphAddDependencies_v2": (2, 704)}}, r"graph decode/\d+: cuGraphAddDependencies_v2 failed"),
        ({"ignore_set": {0x1000, 0x1010, 0x1030}}, r"node \d+ \(kernel \w+\): launch attribute \w+ saved as"),
        ({"rc": {"cuGraphKernelNodeSetAttribute": (0, 705)}}, r"reads back .*\(set: CUresult 705, read: CUresult"),
        ({"rc": {"cuModuleGetFunctionCount": (0, 706)}}, r"cuModuleGetFunctionCount failed \(CUresult 706\)"),
    ],
)
def test_a_failure_is_named_alike_and_what_was_made_is_destroyed(kw, said, monkeypatch):
    for seed in range(12):  # the first file that reaches the failing call
        f = _random_file(seed)
        (msg_a, made_a), (msg_b, made_b) = [_failure(b, f, monkeypatch, **kw) for b in ("ctypes", "compiled")]
        assert msg_a == msg_b, (msg_a, msg_b)
        assert made_a == made_b and made_a[-1][0] == "destroy"  # the graph begun, destroyed, and those before it
        if re.search(said, msg_a):
            return
    pytest.fail(f"no random file reached {said}")


def _refused_alike(monkeypatch, f: GraphFile, bases: list, modules: list, said: str) -> None:
    """Both builders refuse rebuilding ``f`` onto ``bases`` and ``modules`` with the same
    error, which says ``said``."""
    got = []
    for builder in ("ctypes", "compiled"):
        monkeypatch.setenv(graph_flat.BUILDER_ENV, builder)
        with pytest.raises(ExecutorError, match=said) as e:
            rebuild_graphs(f, bases, modules, 0x5, CDriver())
        got.append(str(e.value))
    assert got[0] == got[1]


@needs_compiled
def test_an_operand_in_a_segment_with_no_address_here_is_named_alike(monkeypatch):
    f = _random_file(3)
    for bases in ([BASES[0], BASES[1], None], [None, None, None]):
        _refused_alike(monkeypatch, f, bases, [MODULE], r"which has no address here")


@needs_compiled
def test_a_module_not_loaded_here_is_named_alike(monkeypatch):
    _refused_alike(monkeypatch, _random_file(1), BASES, [None], r"no module with its module's identity")


def _damaged(f: GraphFile, change) -> GraphFile:
    """``f`` with its last graph's first kernel of parameters or relocations changed by ``change``."""
    g = f.graphs[-1]
    i = next(i for i, n in enumerate(g.nodes) if n.kernel is not None and n.kernel.params and n.kernel.relocations)
    nodes = list(g.nodes)
    nodes[i] = msgspec.structs.replace(nodes[i], kernel=change(nodes[i].kernel))
    return msgspec.structs.replace(f, graphs=[*f.graphs[:-1], msgspec.structs.replace(g, nodes=nodes)])


@pytest.mark.parametrize(
    "change, said",
    [
        # a parameter past the argument bytes: the driver reads its size from the pointer handed it
        (lambda k: msgspec.structs.replace(k, params=[*k.params[:-1], (len(k.args) - 4, 8)]), r"parameter \d+ \("),
        (lambda k: msgspec.structs.replace(k, params=[(-8, 8), *k.params[1:]]), r"parameter 0 \(-8, 8\)"),
        # a relocation past the end grew the bytes (a bytearray slice), a negative one wrote from their end
        (lambda k: msgspec.structs.replace(k, relocations=[Relocation(len(k.args) - 4, 0, 0)]), r"relocated address"),
        (lambda k: msgspec.structs.replace(k, relocations=[Relocation(-8, 0, 0)]), r"relocated address at byte -8"),
    ],
)
@pytest.mark.parametrize("builder", ["ctypes", "compiled"])
def test_argument_bytes_a_damaged_file_points_past_are_refused_alike_before_the_node(
    builder, change, said, monkeypatch
):
    """A damaged file's kernel whose parameter or relocation lies outside its argument bytes:
    neither builder hands the driver a pointer past them or patches bytes it does not have."""
    if builder == "compiled" and _graph_build is None:
        pytest.skip("the compiled graph builder is not built here")
    f = _damaged(_random_file(5), change)
    msg, made = _failure(builder, f, monkeypatch)
    assert re.search(said, msg) and msg.endswith("the file is damaged"), msg
    assert made[-1][0] == "destroy"
    if builder == "compiled":
        assert msg == _failure("ctypes", f, monkeypatch)[0]


@pytest.mark.parametrize("edge", [(-1, 0), (0, 10_000), (0, 1, 0), (0, 1, 256, 0, 0), (0, 1, 0, -1, 0)])
@pytest.mark.parametrize("builder", ["ctypes", "compiled"])
def test_an_edge_a_damaged_file_gives_outside_its_graph_is_refused_alike(builder, edge, monkeypatch):
    """An edge of a damaged file: a negative node index (which a list takes from the end: an
    edge to the last node), one past the nodes, a length neither 2 nor 5 (its data dropped), a
    port or type a byte does not hold (truncated). Refused alike, the graph begun destroyed."""
    if builder == "compiled" and _graph_build is None:
        pytest.skip("the compiled graph builder is not built here")
    f = _random_file(5)
    g = f.graphs[-1]
    f = msgspec.structs.replace(f, graphs=[*f.graphs[:-1], msgspec.structs.replace(g, edges=[*g.edges, edge])])
    msg, made = _failure(builder, f, monkeypatch)
    assert msg.endswith(f"is no edge of the graph's {len(g.nodes)} nodes: the file is damaged"), msg
    assert made[-1][0] == "destroy"
    if builder == "compiled":
        assert msg == _failure("ctypes", f, monkeypatch)[0]


# -- the extension's structures and its records -------------------------------------------------


@needs_compiled
@pytest.mark.parametrize("ours", [KernelParams, MemsetParams, Memcpy3D, EdgeData])
def test_the_extensions_structures_are_libcudas_byte_for_byte(ours):
    assert _graph_build is not None
    size, offsets = _graph_build.layouts()[ours.__name__]
    fields = [name for name, *_ in ours._fields_ if name != "pad"]
    assert size == ctypes.sizeof(ours)
    assert offsets == {name: getattr(ours, name).offset for name in fields}


@needs_compiled
def test_records_pointing_outside_their_arrays_are_refused_before_any_call(monkeypatch):
    from array import array

    assert _graph_build is not None
    g = _random_file(0).graphs[0]
    fields = _graph_build.flatten(g, BASES, lambda k, w: ctypes.c_void_p(KERNELS[k.name][0]), {}, {}, ATTRIBUTES)[:-1]
    d = CDriver()
    b = _graph_build.Builder({n: ctypes.cast(d[n], ctypes.c_void_p).value for n in _graph_build.CALLS}, 0xC7)
    assert b.add(0x1, *fields, 8) is None  # as flattened
    kernels, blob = fields[1], fields[2]
    # the last kernel's relocation count past the relocations, the blob cut short, an edge to node 10**6
    for i, bad in [(1, array("q", [*kernels[:-1], 10**6])), (2, blob[:8]), (8, array("q", [0, 10**6, 0, 0, 0]))]:
        d.log.clear()
        wrong = list(fields)
        wrong[i] = bad
        with pytest.raises(ValueError):
            b.add(0x1, *wrong, 8)
        assert d.log == []


# -- which builder runs, and why ------------------------------------------------------------------


def test_the_compiled_graph_builder_is_built_and_chosen_where_a_compiler_exists(monkeypatch):
    """An install here (pip install ., or -e .) builds the extension; `pip install -e .` (or
    `python setup.py build_ext --inplace`) again after editing executor/_graph_build.pyx."""
    monkeypatch.delenv(graph_flat.BUILDER_ENV, raising=False)
    assert _graph_build is not None, "the compiled graph builder is not built: run `pip install -e .` again"
    assert graph_flat.graph_builder() == graph_flat.GraphBuilder("compiled")


def test_the_builder_forced_or_unknown_and_a_driver_in_python(monkeypatch):
    monkeypatch.setenv(graph_flat.BUILDER_ENV, "ctypes")
    assert graph_flat.graph_builder().describe() == "ctypes (CAPTURE_PLAN_GRAPH_BUILDER=ctypes)"
    monkeypatch.setenv(graph_flat.BUILDER_ENV, "fast")
    with pytest.raises(ExecutorError, match=r"CAPTURE_PLAN_GRAPH_BUILDER='fast' names no graph builder"):
        graph_flat.graph_builder()
    # the fakes of tests/test_graph_rebuild.py are Python: the ctypes path runs, saying why
    monkeypatch.delenv(graph_flat.BUILDER_ENV)
    out = rebuild_graphs(_plain_file(), BASES, [MODULE], 0x5, RebuildDriver())
    want = "the driver call cuGraphAddKernelNode_v2 is no C function"
    assert out.builder == (f"ctypes ({want})" if _graph_build is not None else graph_flat.graph_builder().describe())
    if _graph_build is not None:
        monkeypatch.setenv(graph_flat.BUILDER_ENV, "compiled")
        with pytest.raises(ExecutorError, match=f"CAPTURE_PLAN_GRAPH_BUILDER=compiled, but {want}"):
            rebuild_graphs(_plain_file(), BASES, [MODULE], 0x5, RebuildDriver())
