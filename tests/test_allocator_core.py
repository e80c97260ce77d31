"""The compiled allocator core (planner/memory/_core.pyx) against PoolSim, the reference.

Both cores are driven with the same random op streams -- sizes around every
threshold, frees, streams, several pools, native and expandable segments,
given segment addresses, copies -- and random capture programs (repeated
bodies with a carried block, so the layer-cycle skip runs); every address and
the final state of every pool must agree. A mismatch names the seed and the
first differing op. Then: which core runs (the environment variable, the
fallback), and plans byte-identical with either core.
"""

from __future__ import annotations

import itertools
import logging
import os
import random
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import msgspec
import pytest
from hypothesis import given, settings, strategies as st

from capture_plan.planner.memory import allocator
from capture_plan.planner.memory.allocator import FREE, MiB, PoolSim
from capture_plan.planner.memory.core import CORE_ENV, Core, core, new_pool
from capture_plan.planner.memory.program import CARRY, Alloc, Free, Program
from capture_plan.schemas.errors import InputError

ROOT = Path(__file__).resolve().parent.parent

try:
    from capture_plan.planner.memory._core import Pool as CompiledPool
except ImportError:  # not built here: the differential tests skip, test_the_compiled_core_is_built says why
    CompiledPool = None

needs_compiled = pytest.mark.skipif(CompiledPool is None, reason="the compiled allocator core is not built here")

# sizes at and around every rule's threshold: 512 B rounding, the 1 MiB small/large split,
# the 10 MiB segment rule, 2 MiB rounding, pages of 2 and 20 MiB
_EDGES = [0, 1, 511, 512, 513, MiB - 512, MiB, MiB + 1, 2 * MiB, 10 * MiB - 512, 10 * MiB, 20 * MiB, 20 * MiB + 512]


def _size(rng: random.Random) -> int:
    r = rng.random()
    if r < 0.25:
        return rng.choice(_EDGES)
    if r < 0.6:
        return rng.randint(1, MiB)
    if r < 0.9:
        return rng.randint(MiB, 12 * MiB)
    return rng.randint(12 * MiB, 48 * MiB)


def _pair(rng: random.Random) -> tuple:
    """A PoolSim and a compiled pool, alike: native or expandable, default or given segment addresses."""
    expandable = rng.random() < 0.5
    if rng.random() < 0.3:  # bases in no particular order, as a pool that freed memory gets them
        bases = [(1 << 40) + i * (1 << 36) for i in range(64)]
        rng.shuffle(bases)
        more = (1 << 47) + (1 << 36)  # then ascending, however many segments a test makes

        def addresses():
            return itertools.chain(bases, itertools.count(more, 1 << 36))

        return PoolSim(expandable=expandable, addresses=addresses()), CompiledPool(expandable, addresses())
    return PoolSim(expandable=expandable), CompiledPool(expandable)


def _state(pool) -> tuple:
    return (
        pool.reserved,
        pool.allocated,
        pool.peak_reserved,
        pool.peak_allocated,
        pool.segments,
        pool.segment_sizes(),
        pool.layout(),
        pool.free_lists(),
    )


def _compare_states(seed: int, where: str, py, c) -> None:
    a, b = _state(py), _state(c)
    names = ("reserved", "allocated", "peak_reserved", "peak_allocated", "segments", "segments", "layout", "free")
    for name, x, y in zip(names, a, b):
        assert x == y, f"seed {seed}, {where}: {name} differs: python {x} != compiled {y}"


def _py_copy(pool: PoolSim, live: dict) -> tuple[PoolSim, dict]:
    """A copy and the copy's handles for ``live`` (same addresses)."""
    twin = pool.copy()
    by_addr = {b.addr: b for b in twin.blocks()}
    return twin, {k: by_addr[b.addr] for k, b in live.items()}


def run_streams(seed: int) -> int:
    """Random op streams on two or three pools, each run through both cores: every allocation's
    address and size, and each pool's final state, compared. Returns the ops run."""
    rng = random.Random(seed)
    pools = [_pair(rng) for _ in range(rng.randint(1, 3))]
    lives = [({}, {}) for _ in pools]
    alives: list[set[int]] = [set() for _ in pools]
    next_id = 0
    n = 0
    for step in range(rng.randint(1, 12)):
        k = rng.randrange(len(pools))
        py, c = pools[k]
        live_py, live_c = lives[k]
        if rng.random() < 0.1:  # copies continue exactly as the original, which stays as it was
            before = _state(c)
            twin_py, twin_live = _py_copy(py, live_py)
            pools[k] = (twin_py, c.copy())
            lives[k] = (twin_live, dict(live_c))
            assert _state(c) == before, f"seed {seed}, step {step}: copying changed the compiled original"
            continue
        stream = rng.choice((0, 0, 0, 1, 2))
        alive = alives[k]
        ops = []
        for _ in range(rng.randint(1, 40)):
            if alive and rng.random() < 0.4:
                eid = rng.choice(sorted(alive))
                alive.discard(eid)
                ops.append((FREE, eid))
            else:
                ops.append((_size(rng), next_id))
                alive.add(next_id)
                next_id += 1
            if rng.random() < 0.05:
                ops.append((FREE, 10**9))  # a free of an id that is not live does nothing
        py.run(ops, live_py, stream)
        c.run(ops, live_c, stream)
        for i, (nbytes, eid) in enumerate(ops):
            if nbytes >= 0 and live_py.get(eid) is not None and eid in live_c:
                got_py = (live_py[eid].addr, live_py[eid].size)
                got_c = c.block(live_c[eid])[:2]
                assert got_py == got_c, (
                    f"seed {seed}, step {step}, op {i} alloc({nbytes}) on stream {stream} of pool {k}: "
                    f"python (addr, size) {got_py} != compiled {got_c}"
                )
        assert sorted(live_py) == sorted(live_c), f"seed {seed}, step {step}: live ids differ"
        _compare_states(seed, f"step {step}, pool {k}", py, c)
        n += len(ops)
    return n


_KINDS = ("temp",) * 6 + ("output", "output", "workspace", "library")


def random_program(rng: random.Random) -> Program:
    """A capture program: prologue, a body repeated with a carried block, epilogue; sizes from a
    small palette, so that the pool's state between layers recurs (the cycle skip runs)."""
    palette = [_size(rng) for _ in range(rng.randint(1, 6))]
    ids = iter(range(1, 10**6))

    def section(n: int, live: list[int], may_free: tuple[int, ...] = ()) -> list:
        ops: list = []
        for _ in range(n):
            if (live or may_free) and rng.random() < 0.4:
                pick = rng.choice(live + list(may_free))
                if pick in live:
                    live.remove(pick)
                ops.append(Free(pick))
            else:
                eid = next(ids)
                live.append(eid)
                ops.append(Alloc(rng.choice(palette), eid, rng.choice(_KINDS)))
        return ops

    pro_live: list[int] = []
    prologue = section(rng.randint(0, 8), pro_live)
    repeats = rng.choice((0, 1, 2, 3, 8, 32, 80))
    carry_in = rng.choice(pro_live) if pro_live and rng.random() < 0.8 else None
    body_live: list[int] = []
    body = ([Free(CARRY)] if rng.random() < 0.9 else []) + section(rng.randint(0, 8), body_live)
    if not body_live:
        eid = next(ids)
        body.append(Alloc(rng.choice(palette), eid, rng.choice(_KINDS)))
        body_live.append(eid)
    rng.shuffle(body_live)
    carry_out = body_live[0]
    epi_live: list[int] = []
    epilogue = section(rng.randint(0, 6), epi_live, tuple(i for i in pro_live if i != carry_in) + (CARRY,))
    return Program(
        prologue=tuple(prologue),
        body=tuple(body) if repeats else (),
        repeats=repeats,
        epilogue=tuple(epilogue),
        carry_in=carry_in,
        carry_out=carry_out if repeats else CARRY,
        carry_kind=rng.choice((None, None, "output", "temp")),
    )


def _resized(rng: random.Random, prog: Program) -> Program:
    """``prog`` with other allocation sizes, naming ``prog`` as the program it shares its
    structure with (what planner/memory/workload.py's analytic families do): the compiled core
    converts it by resizing ``prog``'s compiled form."""

    def resize(ops):
        return tuple(Alloc(_size(rng), op.id, op.kind) if type(op) is Alloc else op for op in ops)

    twin = msgspec.structs.replace(
        prog, prologue=resize(prog.prologue), body=resize(prog.body), epilogue=resize(prog.epilogue)
    )
    twin.__dict__["_same_structure"] = prog
    return twin


def run_captures(seed: int) -> int:
    """Random captures into pools through both cores' ``capture``: touched spans, protected
    outputs (in order) and every pool's state after each capture compared. Returns the captures."""
    rng = random.Random(seed)
    pools = [_pair(rng) for _ in range(rng.randint(1, 2))]
    programs = [random_program(rng) for _ in range(rng.randint(1, 4))]
    programs += [_resized(rng, p) for p in programs if rng.random() < 0.5]
    n = rng.randint(1, 8)
    for i in range(n):
        k = rng.randrange(len(pools))
        py, c = pools[k]
        prog = rng.choice(programs)
        view = rng.random() < 0.5
        record = rng.random()
        spans_py, spans_c = (set(), set()) if record < 0.6 else (None, None)
        outs_py, outs_c = ([], []) if record < 0.3 else (None, None)
        if rng.random() < 0.2:
            pools[k] = (py, c) = (py.copy(), c.copy())  # nothing live outside a capture: no handles to map
        if rng.random() < 0.2:
            size = rng.choice(_EDGES)  # a library workspace, never freed
            py.alloc(size)
            c.alloc(size)
        before = (py.copy(), c.copy())
        py.capture(prog, view, spans_py, outs_py)
        c.capture(prog, view, spans_c, outs_c)
        if (spans_py, outs_py, _state(py)) != (spans_c, outs_c, _state(c)):
            raise AssertionError(
                f"seed {seed}, capture {i} (pool {k}, view {view}): " + _first_difference(prog, *before)
            )
    return n


def _first_difference(prog: Program, py: PoolSim, c) -> str:
    """Where two pools in the same state first part on ``prog``: its events one by one, the
    repeated body unrolled (no cycle skip) through each core's ``run``."""
    live_py: dict = {}
    live_c: dict = {}
    for j, e in enumerate(prog.flatten()):
        op = ((e.size if e.op == "alloc" else FREE), e.id)
        py.run((op,), live_py)
        c.run((op,), live_c)
        a = (live_py[e.id].addr, live_py[e.id].size) if e.op == "alloc" else None
        b = c.block(live_c[e.id])[:2] if e.op == "alloc" else None
        if a != b or _state(py) != _state(c):
            return f"first differing op: event {j} {e}: python (addr, size) {a} != compiled {b}"
    return "the events agree one by one: the capture loops differ (cycle skip, carried block, frees at the end)"


@needs_compiled
@settings(max_examples=300, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_both_cores_give_every_address_and_state_alike_on_random_op_streams(seed):
    run_streams(seed)


@needs_compiled
@settings(max_examples=300, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_both_cores_capture_random_programs_alike_cycle_skip_included(seed):
    run_captures(seed)


@needs_compiled
def test_the_compiled_core_names_the_carried_block_as_programs_do():
    from capture_plan.planner.memory import _core

    assert _core.CARRY == CARRY == allocator.CARRY


@needs_compiled
def test_a_program_said_to_share_a_structure_it_lacks_is_refused():
    """A wrong ``_same_structure`` (a bug in whoever linked the programs) is an error, not a
    simulation of the other program's ops with this one's sizes."""
    pool = CompiledPool()
    prog = Program(prologue=(Alloc(MiB, 1), Free(1)))
    other = Program(prologue=(Alloc(MiB, 1), Alloc(MiB, 2)))
    other.__dict__["_same_structure"] = prog
    with pytest.raises(ValueError, match="share a structure"):
        pool.capture(other, False)


@needs_compiled
def test_a_fixed_range_of_seeds_agrees_too():
    """The same seeds on every run (hypothesis draws new ones): a regression names its seed."""
    assert sum(run_streams(s) for s in range(200)) > 10_000
    assert sum(run_captures(s) for s in range(200)) > 500


# -- which core runs ---------------------------------------------------------------


@pytest.fixture
def fresh_core(monkeypatch):
    """core() chosen again under this test's environment, and again after it."""
    monkeypatch.delenv(CORE_ENV, raising=False)
    core.cache_clear()
    yield monkeypatch
    core.cache_clear()


def test_the_environment_variable_forces_the_python_core(fresh_core):
    fresh_core.setenv(CORE_ENV, "python")
    assert core() == Core("python", PoolSim, f"{CORE_ENV}=python")
    assert type(new_pool(True)) is PoolSim and new_pool(True).expandable


def test_an_unknown_core_is_one_line_with_a_fix(fresh_core, cli):
    fresh_core.setenv(CORE_ENV, "fortran")
    code, out, err = cli("--version")
    assert code == 1 and out == ""
    assert err == (
        f"planner: error: environment variable {CORE_ENV}: {CORE_ENV}='fortran' names no allocator core "
        f"(python, compiled or auto); fix: unset {CORE_ENV}\n"
    )


def test_a_core_that_does_not_load_falls_back_with_one_info_line(fresh_core, caplog):
    fresh_core.setitem(sys.modules, "capture_plan.planner.memory._core", None)  # import raises ImportError
    with caplog.at_level(logging.INFO, logger="capture_plan.schemas.extension"):
        got = core()
        core()
        assert type(new_pool()) is PoolSim
    assert got.name == "python" and got.why.startswith("the compiled allocator core did not load: ")
    assert [r.getMessage() for r in caplog.records] == [f"allocator core: running python; {got.why}"]
    # required where it did not load: an error, not a silent fallback
    core.cache_clear()
    fresh_core.setenv(CORE_ENV, "compiled")
    with pytest.raises(InputError, match=f"{CORE_ENV}=compiled, but the compiled allocator core did not load"):
        core()


def _compiler() -> bool:
    """A C compiler and Python's headers: what building the extension needs."""
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    headers = Path(sysconfig.get_paths()["include"]) / "Python.h"
    return shutil.which(cc) is not None and headers.exists()


@pytest.mark.skipif(not _compiler(), reason="no C compiler or Python headers here: the Python core is expected")
def test_the_compiled_core_is_built_and_chosen_where_a_compiler_exists(fresh_core):
    """An install here (pip install ., or -e .) builds the extension; `pip install -e .` again after
    editing planner/memory/_core.pyx."""
    assert CompiledPool is not None, "the compiled allocator core is not built: run `pip install -e .` again"
    assert core() == Core("compiled", CompiledPool)
    assert type(new_pool()) is CompiledPool


def test_version_says_which_core_runs():
    env = {**os.environ, CORE_ENV: "python"}
    r = subprocess.run(
        [sys.executable, "-m", "capture_plan.planner", "--version"], capture_output=True, text=True, env=env
    )
    assert r.returncode == 0 and r.stdout.splitlines()[1] == f"allocator core: python ({CORE_ENV}=python)"


@pytest.mark.parametrize("forced", ["python", ""])
def test_show_says_which_core_a_check_or_rebuild_here_runs(forced, fresh_core, cli):
    """A plan does not record its core (both give the same bytes): `show` names the one this
    installation runs, the Python one with why."""
    fresh_core.setenv(CORE_ENV, forced)
    code, out, _ = cli("show", str(ROOT / "plans/fa3-ci.json"))
    want = f"python ({CORE_ENV}=python)" if forced else core().describe()
    assert code == 0 and out.splitlines()[-1].startswith(f"allocator core here: {want}; a check or rebuild runs it")


# -- plans ------------------------------------------------------------------------


def _python_core(monkeypatch) -> None:
    import capture_plan.planner.memory.core as memory_core

    monkeypatch.setattr(memory_core, "core", lambda: Core("python", PoolSim, "test"))


@needs_compiled
@pytest.mark.parametrize(
    "kw",
    [
        {"backend": "fa3", "ci": True},
        {"backend": "fa3", "ci": True, "allocator": "expandable"},
        {"backend": "fa3", "ci": True, "speculative": "eagle"},
        {"backend": "flashinfer", "ci": True, "speculative": "eagle", "allocator": "expandable"},
        {"backend": "fa3", "ci": True, "trace": ROOT / "plans" / "traces" / "fa3-ci.json"},
    ],
    ids=["fa3", "expandable", "eagle", "eagle-expandable-flashinfer", "trace"],
)
def test_plans_are_byte_identical_with_either_core(kw, fresh_core):
    from capture_plan.planner import BuildOptions, build_plan, plan_bytes

    compiled = plan_bytes(build_plan(BuildOptions(**kw)))
    _python_core(fresh_core)
    assert plan_bytes(build_plan(BuildOptions(**kw))) == compiled
