"""The allocator differential benchmark (bench.allocator_diff): its parts on the CPU, the
committed GPU measurements replayed through PoolSim, and the real thing on a GPU."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import itertools
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from bench_modules import bench_module
from capture_plan.planner.memory.allocator import MiB, PoolSim, round_size

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data"


ad = bench_module("allocator_diff")


# -- programs -------------------------------------------------------------------


def _check_program(ops):
    """Captures pair up; allocs only inside one; each slot allocated once, freed at most once after."""
    inside, allocated, freed, captures, n = False, set(), set(), 0, 0
    for op in ops:
        if op[0] == "b":
            assert not inside
            inside, captures = True, captures + 1
        elif op[0] == "e":
            assert inside
            inside = False
        elif op[0] == "a":
            assert inside and op[1] not in allocated and op[2] >= 1
            allocated.add(op[1])
            n += 1
        else:
            assert op[0] == "f" and op[1] in allocated and op[1] not in freed
            freed.add(op[1])
            n += 1
    assert not inside and ops[-1] == ["e"]
    return captures, n


def test_programs_are_deterministic_and_well_formed():
    for seed in range(300):
        ops = ad.generate_program(seed)
        assert ops == ad.generate_program(seed)
        captures, n = _check_program(ops)
        assert 1 <= captures <= 4 and 5 <= n <= 40 + 3 * 3
    assert ad.generate_program(1) != ad.generate_program(2)
    assert ad.program_digest(ad.generate_program(7)) == ad.program_digest(ad.generate_program(7))
    with pytest.raises(ValueError):
        ad.generate_program(0, max_ops=4)


def test_programs_cover_every_boundary():
    sizes = [op[2] for s in range(600) for op in ad.generate_program(s) if op[0] == "a"]
    r = [round_size(n) for n in sizes]
    assert any(n < 512 for n in sizes) and any(n % 512 == 1 for n in sizes) and any(n % 512 == 0 for n in sizes)
    assert any(x == MiB for x in r) and any(x == MiB + 512 for x in r)  # last small, first large
    assert any(MiB < x < 10 * MiB for x in r) and any(x == 10 * MiB for x in r) and any(x == 10 * MiB - 512 for x in r)
    assert any(x > 10 * MiB and x % (2 * MiB) == 0 for x in r) and any(x > 10 * MiB and x % (2 * MiB) for x in r)
    assert any(19 * MiB < x <= 20 * MiB for x in r) and any(20 * MiB < x < 21 * MiB for x in r)
    assert max(sizes) <= 48 * MiB
    progs = [ad.generate_program(s) for s in range(300)]
    # repeated sizes (ties between equal free blocks), blocks kept across captures, frees between captures
    assert sum(len({op[2] for op in p if op[0] == "a"}) < sum(op[0] == "a" for op in p) for p in progs) > 100
    assert any(_kept_across(p) for p in progs)
    assert any(p[i][0] == "f" and p[i - 1] == ["e"] for p in progs for i in range(1, len(p)))


def _kept_across(ops):
    born, cap = {}, 0
    for op in ops:
        if op[0] == "b":
            cap += 1
        elif op[0] == "a":
            born[op[1]] = cap
        elif op[0] == "f" and born[op[1]] != cap:
            return True
    return False


# -- checkpoints and comparison ----------------------------------------------------


def _snap_segment(pool, kind, blocks, expandable=False):
    return {
        "segment_pool_id": pool,
        "segment_type": kind,
        "address": 0,
        "is_expandable": expandable,
        "total_size": sum(abs(b) for b in blocks),
        "blocks": [{"size": abs(b), "state": "active_allocated" if b > 0 else "inactive"} for b in blocks],
    }


def test_checkpoint_from_snapshot_takes_only_the_pool_and_reads_blocks():
    snap = [
        _snap_segment([0, 5], "large", [3 * MiB, -17 * MiB], True),
        _snap_segment((0, 6), "large", [20 * MiB]),  # another pool
        _snap_segment([0, 5], "small", [512, -(2 * MiB - 512)], True),
    ]
    del snap[1]["segment_pool_id"]  # the default pool's segments may carry none
    snap.append(_snap_segment((0, 6), "small", [2 * MiB]))
    cp, flags = ad.checkpoint_from_snapshot(snap, ad.pool_key((0, 5)))
    assert cp == {
        "reserved": 22 * MiB,
        "allocated": 3 * MiB + 512,
        "segments": [["large", 20 * MiB], ["small", 2 * MiB]],
        "layout": [["large", [3 * MiB, -17 * MiB]], ["small", [512, -(2 * MiB - 512)]]],
    }
    assert flags == {True}
    bad = _snap_segment([0, 5], "large", [MiB])
    bad["total_size"] = 2 * MiB
    with pytest.raises(ValueError, match="do not add up"):
        ad.checkpoint_from_snapshot([bad], (0, 5))


def test_simulate_gives_one_checkpoint_per_capture():
    ops = [["b"], ["a", 0, 3 * MiB], ["a", 1, 100], ["e"], ["f", 0], ["b"], ["a", 2, MiB + 1], ["e"]]
    native, exp = ad.simulate(ops, False), ad.simulate(ops, True)
    assert [c["reserved"] for c in native] == [22 * MiB, 22 * MiB]
    assert native[1]["layout"] == [["large", [MiB + 512, -(19 * MiB - 512)]], ["small", [512, -(2 * MiB - 512)]]]
    assert exp[0]["segments"] == [["large", 20 * MiB], ["small", 2 * MiB]]
    assert exp == [ad.checkpoint_from_sim(p) for p in _replayed(ops, True)]
    # real addresses: fewer than the model's segments (a mismatch to report, not a crash)
    assert ad.simulate(ops, False, [1 << 40]) == native


def _replayed(ops, expandable):
    pool, live = PoolSim(expandable=expandable), {}
    for op in ops:
        if op[0] == "a":
            live[op[1]] = pool.alloc(op[2])
        elif op[0] == "f":
            pool.free(live.pop(op[1]))
        elif op[0] == "e":
            yield pool


def test_compare_separates_reserved_segments_and_layout():
    a = ad.simulate(ad.generate_program(11), True)
    assert ad.compare(a, a) == {"match": True, "layout": True, "reserved_rel_diff": 0.0, "first_diff": None}
    moved = json.loads(json.dumps(a))
    moved[-1]["layout"][0][1].reverse()  # same sizes, other order: a layout difference only
    c = ad.compare(moved, a)
    assert c["match"] and not c["layout"] and c["first_diff"]["checkpoint"] == len(a) - 1
    bigger = json.loads(json.dumps(a))
    bigger[0]["reserved"] += 20 * MiB
    c = ad.compare(bigger, a)
    assert not c["match"] and c["first_diff"]["checkpoint"] == 0 and c["reserved_rel_diff"] > 0
    assert not ad.compare(a[:-1], a)["match"]


# -- the GPU runner, driven by a fake torch whose allocator is a PoolSim ---------------


class _FakeTensor:
    def __init__(self, alloc, pool, block):
        self._alloc, self._pool, self._block = alloc, pool, block

    def add_(self, _):
        return self

    def __del__(self):
        if self._pool is not None:
            self._alloc.free(self._pool, self._block)


@functools.cache
def _segment_addresses() -> tuple[int, ...]:
    """Segment base addresses in no particular order, as cudaMalloc gives them after
    frees. Drawn once (the draw costs more than a run_mode): every fake allocator
    walks the same sequence from its start, as when each drew it with the same seed."""
    return tuple(a << 41 for a in random.Random(1).sample(range(1, 10**6), 10**5))


class _FakeAllocator:
    """Private pools as PoolSims (``truth_expandable`` is what the 'hardware' does)."""

    def __init__(self, truth_expandable, release=True, fail_at=None):
        self.truth, self.release, self.fail_at = truth_expandable, release, fail_at
        self.addresses = iter(_segment_addresses())
        self.pools, self.use, self.freeable = {}, {}, set()
        self.capturing = None
        self.ids = itertools.count(1)
        self.allocs = 0

    def empty(self, n):
        assert self.capturing is not None, "the harness allocates only inside captures"
        self.allocs += 1
        if self.fail_at is not None and self.allocs == self.fail_at:
            raise RuntimeError("CUDA error: out of memory (fake)")
        pool = self.pools.get(self.capturing)
        if pool is None:
            pool = self.pools[self.capturing] = PoolSim(expandable=self.truth, addresses=self.addresses)
        return _FakeTensor(self, self.capturing, pool.alloc(n))

    def free(self, key, block):
        self.pools[key].free(block)

    def snapshot(self):
        out = [_snap_segment(None, "large", [20 * MiB])]  # the default pool
        for key, pool in self.pools.items():
            for (small, _n, blocks), head in zip(pool.layout(), pool._heads):
                out.append(
                    _snap_segment(
                        list(key), "small" if small else "large", [s if used else -s for s, used in blocks], self.truth
                    )
                )
                out[-1]["address"] = head.addr
        return out

    def reserved(self):
        return sum(p.reserved for p in self.pools.values()) + 20 * MiB

    def empty_cache(self):
        for key in list(self.freeable):
            if self.release and self.pools.get(key, PoolSim()).allocated == 0:
                self.pools.pop(key, None)
                self.freeable.discard(key)


def _fake_torch(alloc):
    class Graph:
        def capture_begin(self, pool):
            assert alloc.capturing is None
            self.key = tuple(pool)
            alloc.use[self.key] = alloc.use.get(self.key, 0) + 1
            alloc.capturing = self.key

        def capture_end(self):
            assert alloc.capturing == self.key
            alloc.capturing = None

        def __del__(self):
            alloc.use[self.key] -= 1
            if alloc.use[self.key] == 0:
                alloc.freeable.add(self.key)

    class Cuda:
        CUDAGraph = Graph

        @staticmethod
        def Stream():
            return object()

        @staticmethod
        @contextlib.contextmanager
        def stream(_):
            yield

        synchronize = staticmethod(lambda: None)
        memory_stats_as_nested_dict = staticmethod(lambda: {"reserved_bytes": {"all": {"current": alloc.reserved()}}})
        empty_cache = staticmethod(alloc.empty_cache)
        memory_snapshot = staticmethod(alloc.snapshot)
        graph_pool_handle = staticmethod(lambda: (0, next(alloc.ids)))

    class Torch:
        uint8 = "uint8"
        cuda = Cuda

        @staticmethod
        def zeros(n, device):
            return _FakeTensor(alloc, None, None)

        @staticmethod
        def empty(n, dtype, device):
            assert dtype == "uint8" and device == "cuda"
            return alloc.empty(n)

    return Torch


def test_run_mode_measures_releases_and_matches_an_exact_allocator():
    for mode in ad.MODES:
        alloc = _FakeAllocator(mode == "expandable")
        res = ad.run_mode(mode, list(range(40)), _fake_torch(alloc))
        assert (res["measured"], res["matches"], res["layout_matches"]) == (40, 40, 40)
        assert res["matches_planner_addresses"] <= 40
        assert res["leaks"] == 0 and res["errors"] == [] and res["mode_check"] == "ok"
        assert res["first_mismatches"] == [] and not alloc.pools  # every pool released
        assert [m["seed"] for m in res["measurements"]] == list(range(40))
        m = res["measurements"][3]
        assert m["checkpoints"] == ad.simulate(ad.generate_program(3), mode == "expandable", m["segment_addrs"])
        # the recorded addresses are the segments' bases, in creation order
        assert len(m["segment_addrs"]) == len(set(m["segment_addrs"])) == len(m["checkpoints"][-1]["segments"]) and all(
            a % (1 << 41) == 0 for a in m["segment_addrs"]
        )


def test_run_mode_reports_mismatches_wrong_mode_leaks_and_errors():
    # the 'hardware' runs native while we claim expandable: mismatches and a wrong mode
    res = ad.run_mode("expandable", list(range(30)), _fake_torch(_FakeAllocator(False)), first=3)
    assert res["matches"] < 30 and len(res["first_mismatches"]) == 3
    mm = res["first_mismatches"][0]
    assert mm["ops"] == ad.generate_program(mm["seed"]) and mm["real"] != mm["sim"]
    assert (
        mm["first_diff"]["real"]["reserved"] != mm["first_diff"]["sim"]["reserved"]
        or mm["first_diff"]["real"]["segments"] != mm["first_diff"]["sim"]["segments"]
    )
    assert res["mode_check"].startswith("wrong") and res["max_reserved_rel_diff"] > 0
    # a fixture keeps the mismatches, and replaying it on the CPU finds them again
    data = {"date": "d", "generator": {**ad.GENERATOR, "max_ops": 40}, "modes": {"expandable": res}}
    fx = ad.make_fixture(data, 2)
    bad = {m["seed"] for m in res["first_mismatches"]}
    assert bad <= {p["seed"] for p in fx["programs"]}
    assert set(ad.replay(fx["programs"])["expandable"]["mismatched_seeds"]) >= bad
    # pools never released
    res = ad.run_mode("native", list(range(5)), _fake_torch(_FakeAllocator(False, release=False)))
    assert res["leaks"] == 5
    # an error mid-program: recorded, the capture is ended, the run stops
    alloc = _FakeAllocator(False, fail_at=30)
    res = ad.run_mode("native", list(range(10)), _fake_torch(alloc))
    assert len(res["errors"]) == 1 and "out of memory" in res["errors"][0] and res["measured"] < 10
    assert alloc.capturing is None
    data = {"device": "fake", "torch": "0", "seconds": 1, "modes": {"native": res}}
    assert ad.failed(data) and "1 error(s)" in ad.summary_line(data)


def _results(tmp_path):
    """A parent-style results file from fake runs of both modes."""
    modes = {m: ad.run_mode(m, list(range(100, 130)), _fake_torch(_FakeAllocator(m == "expandable"))) for m in ad.MODES}
    data = {
        "bench": "allocator_diff",
        "date": "2026-01-01T00:00:00+00:00",
        "device": "fake",
        "torch": "0",
        "generator": {**ad.GENERATOR, "max_ops": 40},
        "seconds": 2.0,
        "modes": modes,
    }
    data["summary"] = ad.summary_line(data)
    path = tmp_path / "out.json"
    ad.write_json(path, data)
    return path, data


def test_results_recheck_on_cpu_and_fixture_roundtrip(tmp_path, capsys):
    path, data = _results(tmp_path)
    assert not ad.failed(data)
    assert data["summary"].startswith("allocator_diff: native 30/30 match (layout 30; ")
    assert "; expandable 30/30 match (layout 30; " in data["summary"]
    res = ad.replay(ad.programs_of(json.loads(path.read_text())))
    assert {m: (r["programs"], r["matches"]) for m, r in res.items()} == {"native": (30, 30), "expandable": (30, 30)}
    assert ad.main(["--recheck", str(path)]) == 0
    assert capsys.readouterr().out.splitlines()[-1].endswith("all match")
    fixture = tmp_path / "fixture.json"
    ad.write_json(fixture, ad.make_fixture(data, 5))
    fx = json.loads(fixture.read_text())
    assert len(fx["programs"]) == 10 and all("ops" in p for p in fx["programs"])
    assert len(fixture.read_text().splitlines()) > 10  # one program per line
    assert ad.main(["--recheck", str(fixture)]) == 0
    # a measurement the model disagrees with
    fx["programs"][0]["checkpoints"][0]["reserved"] += 2 * MiB
    fixture.write_text(json.dumps(fx))
    assert ad.main(["--recheck", str(fixture)]) == 1
    # a seed whose program changed since it was measured
    raw = json.loads(path.read_text())
    raw["modes"]["native"]["measurements"][0]["digest"] = "0" * 16
    path.write_text(json.dumps(raw))
    assert ad.main(["--recheck", str(path)]) == 1
    assert "re-measure on a GPU" in capsys.readouterr().err


def test_parent_runs_one_child_per_mode_and_merges(tmp_path, capsys, monkeypatch):
    """The parent process: children (faked here) per mode, merged results, fixture, summary last."""
    calls, failing = [], set()
    real_run = subprocess.run

    def child(cmd, capture_output, text, timeout, cwd=None):
        if cmd[1:3] != ["-m", "bench.allocator_diff"]:
            return real_run(cmd, capture_output=capture_output, text=text, timeout=timeout, cwd=cwd)  # git: the header
        assert cwd == ROOT
        args = dict(zip(cmd[3::2], cmd[4::2]))
        mode = args["--mode"]
        calls.append(mode)
        if mode in failing:
            return subprocess.CompletedProcess(cmd, 1, "", "Traceback ...\nRuntimeError: CUDA error (fake)\n")
        seeds = list(range(int(args["--seed"]), int(args["--seed"]) + int(args["--programs"])))
        res = ad.run_mode(mode, seeds, _fake_torch(_FakeAllocator(mode == "expandable")), int(args["--max-ops"]))
        ad.write_json(Path(args["--out"]), {**res, "device": "fake GPU", "torch": "2.11-fake"})
        return subprocess.CompletedProcess(cmd, 0, "", f"{mode}: progress\n")

    monkeypatch.setattr(ad.subprocess, "run", child)
    out, fx = tmp_path / "r" / "out.json", tmp_path / "fx.json"
    assert ad.main(["--programs", "12", "--seed", "5", "--out", str(out), "--fixture", str(fx)]) == 0
    assert calls == ["native", "expandable"]
    printed = capsys.readouterr()
    assert printed.out.splitlines()[-1].startswith("allocator_diff: native 12/12 match")
    assert "expandable: progress" in printed.err
    data = json.loads(out.read_text())
    assert data["device"] == "fake GPU" and data["torch"] == "2.11-fake" and data["date"]
    assert data["summary"] == printed.out.splitlines()[-1]
    assert [m["seed"] for m in data["modes"]["expandable"]["measurements"]] == list(range(5, 17))
    assert ad.main(["--recheck", str(fx)]) == 0
    # a child that dies: the mode is reported as failed, the other still runs, exit 1
    failing.add("native")
    out2 = tmp_path / "out2.json"
    assert ad.main(["--programs", "3", "--out", str(out2)]) == 1
    data = json.loads(out2.read_text())
    assert data["modes"]["native"] == {"error": "exit 1: RuntimeError: CUDA error (fake)"}
    assert data["modes"]["expandable"]["matches"] == 3
    assert "native: FAILED (exit 1: RuntimeError: CUDA error (fake))" in capsys.readouterr().out


def test_command_line_refuses_what_it_cannot_do(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        ad.main([])
    assert e.value.code == 2 and "--out is required" in capsys.readouterr().err
    assert ad.main(["--recheck", str(tmp_path / "missing.json")]) == 1
    assert "cannot re-check" in capsys.readouterr().err


def test_child_mode_without_a_gpu_says_so(tmp_path):
    """``--mode`` sets the allocator before torch loads; without CUDA it exits 1 with one line."""
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.allocator_diff",
            "--mode",
            "expandable",
            "--programs",
            "3",
            "--out",
            str(tmp_path / "x.json"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    import torch

    if torch.cuda.is_available():
        assert r.returncode == 0, r.stderr
    else:
        assert r.returncode == 1 and "no CUDA device" in r.stderr and len(r.stderr.strip().splitlines()) == 1


# -- measurements from the GPU, replayed on the CPU ----------------------------------------


def _measurement_files():
    return sorted(DATA.glob("allocator_diff*.json"))


def test_committed_gpu_measurements_match_poolsim():
    files = _measurement_files()
    if not files:
        pytest.skip(
            f"no GPU measurements in {DATA.relative_to(ROOT)}/allocator_diff*.json yet: on an H200 run "
            "`python -m bench.allocator_diff --programs 2000 --out OUT.json --fixture "
            "tests/data/allocator_diff.json` and commit the fixture"
        )
    for f in files:
        res = ad.replay(ad.programs_of(json.loads(f.read_text())))
        assert res, f"{f.name}: no programs"
        for mode, r in res.items():
            assert r["matches"] == r["programs"], f"{f.name}: {mode}: mismatched seeds {r['mismatched_seeds']}"
            if mode == "expandable":  # inside one expandable segment addresses are exact: the layout too
                assert r["layout_matches"] == r["programs"], f"{f.name}: {mode}: layouts differ"


# -- on the GPU ---------------------------------------------------------------------


@pytest.mark.gpu
def test_poolsim_matches_the_real_allocator_in_both_modes(tmp_path):
    out = tmp_path / "allocdiff.json"
    r = subprocess.run(
        [sys.executable, "-m", "bench.allocator_diff", "--programs", "300", "--seed", "1000000", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    data = json.loads(out.read_text())
    for mode in ad.MODES:
        m = data["modes"][mode]
        assert m["errors"] == [] and m["leaks"] == 0 and m["mode_check"] == "ok", m
        assert m["matches"] == m["programs"] == 300, (mode, m["first_mismatches"][:2])
    exp = data["modes"]["expandable"]
    assert exp["layout_matches"] == 300, exp["first_layout_mismatches"][:2]
