"""Every torch entry point the executor, the recording and the adapters (the engine
plugins among them) use, read from torch's wheels: the record
``tests/data/torch_entry_points.toml``, regenerated and compared here.

    python -m bench.torch_entry_points --wheels /tmp/torchwheels            # compare
    python -m bench.torch_entry_points --wheels /tmp/torchwheels --write    # rewrite the record

``--wheels`` is a folder of torch wheels (``pip download --no-deps --only-binary=:all:
--python-version 3.12 --platform manylinux_2_28_x86_64 -d DIR torch==VERSION``, one per
version: the CUDA builds, about 550 MB each; not kept in the repository). Each wheel is read
with zipfile + ast, never installed: the Python modules for functions, classes and their
methods (``torch/cuda/graphs.py``, ``torch/cuda/memory.py``...), the ``.pyi`` stubs for the
C++ bindings (``torch/_C/__init__.pyi``: ``_CUDAGraph``'s methods), and for the keys of a
memory snapshot the TypedDicts of ``torch/cuda/memory.py`` or else the string in
``torch/lib/libtorch_python.so`` (the C++ that builds the snapshot). Each wheel's file name
and sha256 go into the record. Exit 1 where the record differs from what the wheels read
(without ``--write``) or a use of the sources has no row.

The uses come from a source scan (:func:`scan`, ``ast``, no import): a ``torch.`` attribute
chain through the module's own import aliases (``import torch.distributed as dist``;
``dist.get_rank`` is ``torch.distributed.get_rank``), a name imported from torch, a
``hasattr``/``getattr``/``setattr`` of a constant name on such a chain, a member of
``torch.cuda.CUDAGraph`` reached on any object (``g.capture_begin``: the scan has no types,
so every attribute named as one of :data:`GRAPH_MEMBERS` counts), or a key read from a
memory snapshot (``snapshot:NAME``: a constant subscript, ``.get`` or ``==`` operand in a
module that takes a snapshot). Each use keeps the keyword names passed to it, which
tests/test_torch_entry_points.py checks against every torch's signature.

Importing this module imports no torch.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import re
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

#: the folders whose modules the scan reads (the executor, the recording, the adapters and plugins)
SCANNED = ("executor", "adapters", "adapters/plugins")
#: members of torch.cuda.CUDAGraph (the Python class and its C++ base, torch 2.11 to 2.15, as
#: read from the wheels) whose use on any object is a use of the graph's method
GRAPH_MEMBERS = frozenset(
    {
        "capture_begin",
        "capture_end",
        "capture_end_pre",
        "capture_end_post",
        "instantiate",
        "replay",
        "reset",
        "pool",
        "pools",
        "raw_cuda_graph",
        "raw_cuda_graph_exec",
        "enable_debug_mode",
        "debug_dump",
        "register_generator_state",
        "register_capture_start_hook",
        "register_capture_end_hook",
        "register_post_instantiate_hook",
        "register_replay_start_hook",
        "register_replay_end_hook",
        "register_destroy_callback",
        "retain_object",
        "get_currently_capturing_graph",
        "get_graph_data",
    }
)
#: members whose name the project also gives its own attributes (``Pools``: ``self.pools``): a use only when called
_CALLED_ONLY = frozenset({"pools"})
#: calls that take a memory snapshot: a module that makes one has its constant keys scanned
_SNAPSHOTS = frozenset({"torch.cuda.memory_snapshot", "torch.cuda.memory._snapshot"})


@dataclass
class Use:
    """Where one entry point is used, and the keywords passed to it."""

    files: set[str] = field(default_factory=set)
    keywords: set[str] = field(default_factory=set)


def _aliases(tree: ast.Module) -> dict[str, str]:
    """Local name -> the torch dotted name it stands for, from every import in the module."""
    out: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "torch" or a.name.startswith("torch."):
                    out[a.asname or a.name.split(".")[0]] = a.name if a.asname else "torch"
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "torch" or node.module.startswith("torch."):
                for a in node.names:
                    out[a.asname or a.name] = f"{node.module}.{a.name}"
    return out


def _chain(node: ast.AST, aliases: dict[str, str]) -> str | None:
    """The torch dotted name of an attribute chain rooted at an alias, or None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name) or node.id not in aliases:
        return None
    return ".".join([aliases[node.id], *reversed(parts)])


def _keys_read(tree: ast.Module) -> set[str]:
    """Constant strings a snapshot-reading module uses as keys or compares with."""
    keys = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
            if isinstance(node.slice.value, str):
                keys.add(node.slice.value)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
            if node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                keys.add(node.args[0].value)
        elif isinstance(node, ast.Compare) and isinstance(node.left, ast.Subscript):
            keys.update(c.value for c in node.comparators if isinstance(c, ast.Constant) and isinstance(c.value, str))
    return keys


def scan_module(tree: ast.Module, rel: str, uses: dict[str, Use]) -> None:
    """Add the torch uses of one parsed module (``rel``: its path in the repository)."""
    aliases = _aliases(tree)
    if not aliases:
        return
    inner: set[int] = set()  # attribute nodes inside a longer chain: only the longest is a use
    roots: set[int] = set()  # the names chains start from (a use only through their chain)

    def add(name: str, keywords=()) -> None:
        use = uses.setdefault(name, Use())
        use.files.add(rel)
        use.keywords.update(k for k in keywords if k)

    calls = {id(n.func): n for n in ast.walk(tree) if isinstance(n, ast.Call)}
    snapshot = False
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and id(node) not in inner:
            sub = node.value
            while isinstance(sub, ast.Attribute):
                inner.add(id(sub))
                sub = sub.value
            roots.add(id(sub))
            call = calls.get(id(node))
            kws = [k.arg for k in call.keywords] if call is not None else []
            name = _chain(node, aliases)
            if name is not None:
                add(name, kws)
                snapshot = snapshot or name in _SNAPSHOTS
            elif node.attr in GRAPH_MEMBERS and (call is not None or node.attr not in _CALLED_ONLY):
                add(f"torch.cuda.CUDAGraph.{node.attr}", kws)
        elif isinstance(node, ast.Name) and id(node) not in roots and aliases.get(node.id, "torch") != "torch":
            call = calls.get(id(node))
            add(aliases[node.id], [k.arg for k in call.keywords] if call is not None else [])
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id in ("hasattr", "getattr", "setattr") and len(node.args) >= 2:
                const = node.args[1]
                if isinstance(const, ast.Constant) and isinstance(const.value, str):
                    base = _chain(node.args[0], aliases)
                    if base is not None:
                        add(f"{base}.{const.value}")
                    elif const.value in GRAPH_MEMBERS:
                        add(f"torch.cuda.CUDAGraph.{const.value}")
    if snapshot:
        for key in _keys_read(tree):
            add(f"snapshot:{key}")


def scan(root: Path) -> dict[str, Use]:
    """Every torch entry point the scanned folders' modules use, by name."""
    uses: dict[str, Use] = {}
    for folder in SCANNED:
        for path in sorted((root / folder).glob("*.py")):
            rel = path.relative_to(root).as_posix()
            scan_module(ast.parse(path.read_text(), rel), rel, uses)
    return uses


# -- the wheels ---------------------------------------------------------------------------------

#: the committed record
RECORD = Path(__file__).resolve().parent.parent / "tests" / "data" / "torch_entry_points.toml"
#: the TypedDicts (in ``torch.cuda.memory._snapshot``'s docstring) whose fields are a snapshot's keys
_SNAPSHOT_DICTS = ("Snapshot", "Segment", "Block", "TraceEntry")
#: how the project copes with an entry point that is absent or changed in some torch (the
#: record's ``note``; tests/test_torch_entry_points.py wants one for every such row)
NOTES = {
    "torch.cuda.graphs.register_graph_capture_start_hook": "torch 2.14 on; executor/recording.py's capture_hooks "
    "feature-detects it (with the end hook) and wraps capture_begin on the class where it is absent",
    "torch.cuda.graphs.register_graph_capture_end_hook": "torch 2.14 on; see register_graph_capture_start_hook",
    "torch.cuda.CUDAGraph.pools": "torch 2.14 on; executor/recording.py's graph_pools asks pool() where it is absent",
    "torch.cuda.CUDAGraph.capture_begin": "2.14 adds check_input_liveness and takes a MemPool as pool; the "
    "executor passes pool= (a handle) and capture_error_mode= only. The observer of graphs outside the loop "
    "wraps it only where torch has no capture hooks (executor/recording.py); record_graphs wraps it on every "
    "torch (its marker is allocated before the capture, where no hook runs)",
    "torch.cuda.CUDAGraph.capture_end": "2.14 runs capture_end_pre, the capture-end hooks, instantiate (keep_graph"
    "=False) and capture_end_post from Python; wrapping it on the class (record_graphs) still sees every capture",
    "torch.cuda.CUDAGraph.replay": "2.14 instantiates a keep_graph=True graph on its first replay when nothing "
    "did (the executor instantiates it at capture: instantiate_kept)",
    "torch.cuda.CUDAGraph.pool": "2.14 returns _POOL_HANDLE(...), a NewType of the same tuple; pools() lists "
    "every pool the graph retains (use_mem_pool inside a capture)",
}


def _first_string(node: ast.AST) -> str:
    return ast.unparse(node) if len(ast.unparse(node)) <= 160 else ast.unparse(node)[:157] + "..."


class Wheel:
    """One torch wheel's Python modules and stubs, parsed on demand."""

    def __init__(self, path: Path):
        self.path = path
        self.zip = zipfile.ZipFile(path)
        self.names = set(self.zip.namelist())
        self._trees: dict[str, ast.Module] = {}
        self._binary: bytes | None = None
        self._defs_of: dict[str, tuple[dict[str, object], list[str]]] = {}
        m = re.match(r"torch-([^-+]+)", path.name)
        self.version = m.group(1) if m else path.name

    def sha256(self) -> str:
        h = hashlib.sha256()
        with open(self.path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        return h.hexdigest()

    def _file(self, module: str) -> str | None:
        base = module.replace(".", "/")
        for cand in (f"{base}.pyi", f"{base}/__init__.pyi", f"{base}.py", f"{base}/__init__.py"):
            if cand in self.names:
                return cand
        return None

    def tree(self, file: str) -> ast.Module:
        if file not in self._trees:
            self._trees[file] = ast.parse(self.zip.read(file))
        return self._trees[file]

    def binary(self) -> bytes:
        if self._binary is None:
            self._binary = self.zip.read("torch/lib/libtorch_python.so")
        return self._binary

    # a module's top-level names: (def/class/assign node) or (import target), star imports
    def _defs(self, module: str, file: str) -> tuple[dict[str, object], list[str]]:
        if file in self._defs_of:
            return self._defs_of[file]
        defs: dict[str, object] = {}
        stars: list[str] = []

        def define(name: str, node: ast.AST) -> None:
            got = defs.setdefault(name, [])
            if isinstance(got, list):  # an import of the name first: the import is followed
                got.append(node)

        pkg = module if file.endswith(("__init__.py", "__init__.pyi")) else module.rsplit(".", 1)[0]

        def walk(body):
            for node in body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    define(node.name, node)
                elif isinstance(node, ast.Assign):
                    for t in node.targets:
                        if isinstance(t, ast.Name):
                            define(t.id, node)
                elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                    define(node.target.id, node)
                elif isinstance(node, ast.ImportFrom):
                    src = node.module or ""
                    if node.level:
                        src = ".".join(pkg.split(".")[: len(pkg.split(".")) - node.level + 1] + ([src] if src else []))
                    for a in node.names:
                        if a.name == "*":
                            stars.append(src)
                        else:
                            defs.setdefault(a.asname or a.name, f"{src}.{a.name}")
                elif isinstance(node, ast.Import):
                    for a in node.names:
                        if a.asname:
                            defs.setdefault(a.asname, a.name)
                elif isinstance(node, (ast.If, ast.Try, ast.With)):
                    for part in ("body", "orelse", "finalbody", "handlers"):
                        for sub in getattr(node, part, []) or []:
                            walk(sub.body if isinstance(sub, ast.ExceptHandler) else [sub])

        walk(self.tree(file).body)
        self._defs_of[file] = (defs, stars)
        return defs, stars

    def lookup(self, dotted: str, depth: int = 0) -> tuple[str, object] | None:
        """(file, definition) of ``dotted``: a module's file and "module", or the nodes that
        define the name; None where the wheel does not have it."""
        if depth > 12:
            return None
        parts = dotted.split(".")
        for i in range(len(parts), 0, -1):
            module = ".".join(parts[:i])
            file = self._file(module)
            if file is not None:
                return (file, "module") if i == len(parts) else self._member(module, file, parts[i:], depth)
        return None

    def _member(self, module: str, file: str, rest: list[str], depth: int):
        defs, stars = self._defs(module, file)
        name, more = rest[0], rest[1:]
        got = defs.get(name)
        if isinstance(got, str):  # imported: follow it
            return self.lookup(".".join([got, *more]), depth + 1)
        if got is not None:
            cls = next((n for n in got if isinstance(n, ast.ClassDef)), None)  # type: ignore[union-attr]
            if not more:
                return file, got
            if cls is not None:
                return self._class_member(module, file, cls, more, depth)
            return None
        for star in stars:
            found = self.lookup(".".join([star, *rest]), depth + 1)
            if found is not None:
                return found
        if module == "torch":  # torch/__init__.py copies torch._C._VariableFunctions' names into torch
            return self.lookup(".".join(["torch._C._VariableFunctions", *rest]), depth + 1)
        return None

    def _class_member(self, module: str, file: str, cls: ast.ClassDef, rest: list[str], depth: int):
        nodes = [
            n
            for n in cls.body
            if (isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.name == rest[0])
            or (isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name) and n.target.id == rest[0])
            or (isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == rest[0] for t in n.targets))
        ]
        if nodes and len(rest) == 1:
            return file, nodes
        defs, _ = self._defs(module, file)
        for base in cls.bases:  # the C++ base (torch._C._CUDAGraph) holds what the class does not
            text = ast.unparse(base)
            head, _, tail = text.partition(".")
            got = defs.get(head)
            full = (f"{got}.{tail}" if tail else got) if isinstance(got, str) else f"{module}.{text}"
            found = self.lookup(".".join([full, *rest]), depth + 1)
            if found is not None:
                return found
        return None

    def snapshot_key(self, key: str) -> str:
        """Where the wheel declares a snapshot key (or a trace entry's action): a field (or a
        Literal value) of the TypedDicts ``torch.cuda.memory._snapshot``'s docstring declares,
        else the C++ that writes the snapshot (the string in libtorch_python.so); "absent"."""
        snap = self.lookup("torch.cuda.memory._snapshot")
        doc = ast.get_docstring(snap[1][0]) or "" if snap is not None and snap[1] != "module" else ""  # type: ignore[index]
        for block in re.split(r"\n\s*class ", doc)[1:]:
            cls = block.split("(", 1)[0]
            if cls in _SNAPSHOT_DICTS and re.search(rf"^\s+{re.escape(key)}:", block, re.M):
                return f"{cls}.{key} [torch/cuda/memory.py: _snapshot's docstring]"
            if cls in _SNAPSHOT_DICTS and f'"{key}"' in block:
                return f'{cls} value "{key}" [torch/cuda/memory.py: _snapshot\'s docstring]'
        if b"\0" + key.encode() + b"\0" in self.binary():
            return "written by C++ [torch/lib/libtorch_python.so]"
        return "absent"

    def read(self, name: str) -> str:
        """One entry point as this wheel has it: its signature and file, or "absent"."""
        if name.startswith("snapshot:"):
            return self.snapshot_key(name.split(":", 1)[1])
        found = self.lookup(name)
        if found is None:
            return "absent"
        file, nodes = found
        if nodes == "module":
            return f"module [{file}]"
        return f"{_signature(self, name, nodes)} [{file}]"


def _signature(wheel: Wheel, name: str, nodes) -> str:
    texts = []
    for n in nodes:
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
            ret = f" -> {ast.unparse(n.returns)}" if n.returns is not None else ""
            deco = "".join(
                f"@{ast.unparse(d)} " for d in n.decorator_list if ast.unparse(d) in ("staticmethod", "property")
            )
            texts.append(f"{deco}def ({ast.unparse(n.args)}){ret}")
        elif isinstance(n, ast.ClassDef):
            init = wheel.lookup(f"{name}.__init__") or wheel.lookup(f"{name}.__new__")
            sig = _signature(wheel, name + ".__init__", init[1]) if init is not None and init[1] != "module" else ""
            texts.append(f"class {sig.removeprefix('def ')}".strip())
        elif isinstance(n, ast.AnnAssign):
            texts.append(f": {_first_string(n.annotation)}" + (f" = {_first_string(n.value)}" if n.value else ""))
        elif isinstance(n, ast.Assign):
            texts.append(f"= {_first_string(n.value)}")
    return " | ".join(dict.fromkeys(texts))


def read_wheels(folder: Path, names) -> dict:
    """The record: every wheel's version, file and sha256, and per name its readings."""
    wheels = sorted((Wheel(p) for p in folder.glob("torch-*.whl")), key=lambda w: tuple(map(int, w.version.split("."))))
    if not wheels:
        raise SystemExit(
            f"torch_entry_points: no torch-*.whl in {folder}; fix: pip download --no-deps "
            f"--only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 -d {folder} torch==2.14.0"
        )
    return {
        "wheels": [{"version": w.version, "file": w.path.name, "sha256": w.sha256()} for w in wheels],
        "read": {name: {w.version: w.read(name) for w in wheels} for name in sorted(names)},
    }


def _q(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def render(record: dict, uses: dict[str, Use]) -> str:
    """The record as TOML, deterministic: wheels, then one [[entry]] per name."""
    out = [
        "# torch entry points the executor, the recording and the adapters use, read from torch's wheels.",
        "# Generated: python -m bench.torch_entry_points --wheels DIR --write (a row's note: NOTES there).",
        "",
    ]
    for w in record["wheels"]:
        out += [
            "[[wheels]]",
            f"version = {_q(w['version'])}",
            f"file = {_q(w['file'])}",
            f"sha256 = {_q(w['sha256'])}",
            "",
        ]
    for name, read in record["read"].items():
        use = uses.get(name, Use())
        out += [
            "[[entry]]",
            f"name = {_q(name)}",
            "used_in = [" + ", ".join(_q(f) for f in sorted(use.files)) + "]",
            "keywords = [" + ", ".join(_q(k) for k in sorted(use.keywords)) + "]",
        ]
        if name in NOTES:
            out.append(f"note = {_q(NOTES[name])}")
        out.append("[entry.read]")
        out += [f"{_q(v)} = {_q(text)}" for v, text in read.items()]
        out.append("")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.torch_entry_points", description=__doc__.split("\n\n")[0])
    ap.add_argument("--wheels", type=Path, required=True, help="a folder of torch-*.whl (one per version)")
    ap.add_argument(
        "--write", action="store_true", help=f"rewrite the record ({RECORD.relative_to(RECORD.parents[2])})"
    )
    args = ap.parse_args(argv)
    uses = scan(RECORD.parents[2])
    text = render(read_wheels(args.wheels, uses), uses)
    if args.write:
        RECORD.write_text(text)
        print(f"torch_entry_points: wrote {RECORD} ({len(uses)} entry points)")
        return 0
    if RECORD.exists() and RECORD.read_text() == text:
        print(f"torch_entry_points: the record holds ({len(uses)} entry points)")
        return 0
    print(
        f"torch_entry_points: the record differs from the wheels and the sources; fix: python -m "
        f"bench.torch_entry_points --wheels {args.wheels} --write, and read the diff"
    )
    return 1


if __name__ == "__main__":
    sys.exit(main())
