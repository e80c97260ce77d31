"""The record of torch entry points (tests/data/torch_entry_points.toml, read from torch's
wheels by ``python -m bench.torch_entry_points``) against the sources that use them, and
the recording's observer of outside graphs on both of its branches: torch's capture hooks
(torch 2.14 on) and the wrapper of ``capture_begin`` (2.11, 2.13), on fakes."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import tomllib

from bench_modules import bench_module

ROOT = Path(__file__).resolve().parent.parent
tep = bench_module("torch_entry_points")
RECORD = tomllib.loads(tep.RECORD.read_text())
ROWS = {e["name"]: e for e in RECORD["entry"]}
VERSIONS = [w["version"] for w in RECORD["wheels"]]


def test_every_torch_use_of_the_sources_has_its_row_and_no_row_is_stale():
    """A new torch use (or a new keyword passed to one) fails here until the record is
    regenerated from the wheels: ``python -m bench.torch_entry_points --wheels DIR --write``."""
    uses = tep.scan(ROOT)
    assert sorted(set(uses) - set(ROWS)) == [], "used but not in the record"
    assert sorted(set(ROWS) - set(uses)) == [], "in the record but used nowhere"
    for name, use in uses.items():
        assert ROWS[name]["used_in"] == sorted(use.files), name
        assert ROWS[name]["keywords"] == sorted(use.keywords), name


def test_the_scan_sees_aliases_graph_members_and_snapshot_keys():
    src = (
        "import torch\nimport torch.distributed as dist\nfrom torch.nn.attention import sdpa_kernel\n"
        "def f(g, s):\n    dist.get_rank(group=None)\n    sdpa_kernel([])\n    g.capture_begin(pool=1)\n"
        "    hasattr(torch.cuda, 'MemPool')\n    snap = torch.cuda.memory_snapshot()\n"
        "    return s['total_size'], s.get('segment_pool_id'), self.pools\n"
    )
    uses: dict = {}
    tep.scan_module(ast.parse(src), "x.py", uses)
    assert set(uses) == {
        "torch.distributed.get_rank",
        "torch.nn.attention.sdpa_kernel",
        "torch.cuda.CUDAGraph.capture_begin",
        "torch.cuda",
        "torch.cuda.MemPool",
        "torch.cuda.memory_snapshot",
        "snapshot:total_size",
        "snapshot:segment_pool_id",
    }
    assert uses["torch.cuda.CUDAGraph.capture_begin"].keywords == {"pool"}


def test_each_wheel_is_named_with_its_sha256_and_every_row_reads_every_wheel():
    assert VERSIONS == sorted(VERSIONS, key=lambda v: tuple(map(int, v.split("."))))
    assert {"2.11.0", "2.13.0", "2.14.0", "2.14.1", "2.15.0"} <= set(VERSIONS)
    for w in RECORD["wheels"]:
        assert w["file"].startswith(f"torch-{w['version']}-") and w["file"].endswith(".whl")
        assert re.fullmatch(r"[0-9a-f]{64}", w["sha256"])
    for name, row in ROWS.items():
        assert list(row["read"]) == VERSIONS, name


def test_an_entry_point_absent_from_some_torch_says_how_the_code_copes():
    missing = [n for n, r in ROWS.items() if "absent" in r["read"].values() and not r.get("note")]
    assert missing == []


def _params(reading: str) -> list[set[str] | None]:
    """Per overload of a reading: its parameter names (None: it takes **kwargs)."""
    out = []
    for part in reading.rsplit(" [", 1)[0].split(" | def "):
        sig = part.removeprefix("@staticmethod ").removeprefix("def ").removeprefix("class ")
        sig = sig.split(" -> ")[0] if sig.startswith("(") else ""
        if not sig:
            continue
        args = ast.parse(f"def f{sig}: pass").body[0].args  # type: ignore[attr-defined]
        names = {a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]}
        out.append(None if args.kwarg is not None else names)
    return out


def test_every_keyword_the_code_passes_is_a_parameter_in_every_torch():
    bad = []
    for name, row in ROWS.items():
        for version, reading in row["read"].items():
            overloads = _params(reading)
            if row["keywords"] and reading != "absent" and overloads:
                if not any(p is None or set(row["keywords"]) <= p for p in overloads):
                    bad.append(f"{name} on torch {version}: {row['keywords']} not in {reading}")
    assert bad == []


def test_the_graph_members_the_scan_knows_are_the_wheels_members():
    """GRAPH_MEMBERS names members of torch.cuda.CUDAGraph: each is read in some wheel's
    record row or is a member torch's graph class defines (read from the stubs once)."""
    for name in ROWS:
        if name.startswith("torch.cuda.CUDAGraph."):
            assert name.rsplit(".", 1)[1] in tep.GRAPH_MEMBERS
            assert any(r != "absent" for r in ROWS[name]["read"].values()), name


# -- the observer of graphs recorded outside the loop ------------------------------------------


class _Handle:
    def __init__(self, registry, fn):
        self.registry, self.fn = registry, fn
        registry.append(fn)

    def remove(self):
        self.registry.remove(self.fn)


class _HookedTorch:
    """torch 2.14's global capture hooks on a fake: registries and the graph that runs them."""

    def __init__(self):
        self.starts: list = []
        self.ends: list = []

    def register_graph_capture_start_hook(self, fn):
        return _Handle(self.starts, fn)

    def register_graph_capture_end_hook(self, fn):
        return _Handle(self.ends, fn)


class _Graph:
    """A graph with torch 2.14's capture protocol: start hooks inside capture_begin, end
    hooks after the capture ended; ``pools()`` answers only after a successful capture."""

    def __init__(self, torch_hooks, extra_pools=()):
        self.hooks, self.extra, self._pool, self.ended = torch_hooks, list(extra_pools), None, False

    def capture_begin(self, pool=None, capture_error_mode="global"):
        self._pool = pool
        for fn in list(self.hooks.starts):
            fn(self)

    def capture_end(self):
        self.ended = True
        for fn in list(self.hooks.ends):
            try:  # as torch 2.14's _run_global_hooks: a hook's error is swallowed
                fn(self)
            except Exception:  # noqa: BLE001, S110
                pass

    def pools(self):
        if not self.ended:
            raise RuntimeError("Called CUDAGraph::pools() without a preceding successful capture.")
        return [self._pool, *self.extra]


@pytest.fixture
def hooked(monkeypatch):
    torch = pytest.importorskip("torch")

    hooks = _HookedTorch()
    monkeypatch.setattr(
        torch.cuda.graphs, "register_graph_capture_start_hook", hooks.register_graph_capture_start_hook, raising=False
    )
    monkeypatch.setattr(
        torch.cuda.graphs, "register_graph_capture_end_hook", hooks.register_graph_capture_end_hook, raising=False
    )
    return hooks


def test_with_torchs_capture_hooks_the_observer_counts_at_capture_end_and_wraps_nothing(hooked):
    import torch

    from capture_plan.executor.recording import OutsideGraphs, capture_hooks

    assert capture_hooks() is not None
    begin = torch.cuda.CUDAGraph.capture_begin
    engine, other = (0, 7), (0, 8)
    seen = OutsideGraphs(frozenset({engine}))
    seen.start()
    assert torch.cuda.CUDAGraph.capture_begin is begin  # the class is left alone
    assert len(hooked.starts) == len(hooked.ends) == 1

    outside = _Graph(hooked)
    outside.capture_begin(pool=engine)  # pools() would raise here: read at the end only
    outside.capture_end()
    mine = _Graph(hooked)
    with seen.own():
        mine.capture_begin(pool=engine)
    mine.capture_end()  # the loop's own: not counted
    elsewhere = _Graph(hooked)
    elsewhere.capture_begin(pool=other)
    elsewhere.capture_end()
    failed = _Graph(hooked)
    failed.capture_begin(pool=engine)  # never ends: not counted
    # one graph, several pools (torch 2.14: use_mem_pool inside the capture): the engine's among them
    several = _Graph(hooked, extra_pools=[engine])
    several.capture_begin(pool=other)
    several.capture_end()
    assert seen.count == 2

    seen.stop()
    assert hooked.starts == hooked.ends == []  # the handles removed
    late = _Graph(hooked)
    late.capture_begin(pool=engine)
    late.capture_end()
    assert seen.count == 2


def test_without_capture_hooks_the_observer_wraps_capture_begin_and_restores_it(fake, monkeypatch):
    import torch

    from capture_plan.executor import recording
    from capture_plan.executor.recording import OutsideGraphs

    monkeypatch.delattr(torch.cuda.graphs, "register_graph_capture_start_hook", raising=False)
    assert recording.capture_hooks() is None  # torch 2.11 / 2.13
    cls = torch.cuda.CUDAGraph
    begin = cls.capture_begin
    engine = torch.cuda.graph_pool_handle()
    seen = OutsideGraphs(frozenset({engine}))
    seen.start()
    assert cls.capture_begin is not begin
    g = torch.cuda.CUDAGraph()
    g.capture_begin(pool=engine)
    g.capture_end()
    with seen.own():
        torch.cuda.CUDAGraph().capture_begin(pool=engine)
    torch.cuda.CUDAGraph().capture_begin(pool=torch.cuda.graph_pool_handle())
    assert seen.count == 1
    seen.stop()
    assert cls.capture_begin is begin


def test_graph_pools_asks_pools_where_torch_has_it_else_pool():
    pytest.importorskip("torch")
    from capture_plan.executor.recording import graph_pools

    class Old:
        def pool(self):
            return (0, 3)

    class New(Old):
        def pools(self):
            return [(0, 3), (1, 2)]

    assert graph_pools(Old()) == [(0, 3)]
    assert graph_pools(New()) == [(0, 3), (1, 2)]


def test_a_pool_the_end_hook_cannot_read_is_raised_at_stop_not_swallowed(hooked):
    """torch swallows a global hook's error: a graph whose pools() raises would be left out of the
    count unsaid, so the observer keeps the error and stop() raises it."""
    from capture_plan.executor import ExecutorError
    from capture_plan.executor.recording import OutsideGraphs

    engine = (0, 7)
    seen = OutsideGraphs(frozenset({engine}))
    seen.start()

    class Unreadable(_Graph):
        def pools(self):
            raise TypeError("a pool handle of a kind this code does not know")

    g = Unreadable(hooked)
    g.capture_begin(pool=engine)
    g.capture_end()
    with pytest.raises(ExecutorError, match="could not be counted: its pools did not read"):
        seen.stop()
    assert hooked.starts == hooked.ends == []  # the handles removed all the same
