"""Allocation programs: typed ops, and the compact form the allocator runs."""

from __future__ import annotations

import pytest

from capture_plan.planner.allocator import FREE, PoolSim
from capture_plan.planner.program import CARRY, Alloc, Free, Program, ops_from_events
from capture_plan.planner.resources import backend
from capture_plan.planner.workload import PHASE_KINDS, analytic_program
from capture_plan.schemas.spec import Model, Phase
from capture_plan.schemas.trace import Event

SMALL = Model(layers=2, hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=512, vocab=1000)


def _phase(kind: str) -> Phase:
    return Phase(
        name=kind,
        kind=kind,
        sizes=[8],
        tokens_per_request=4 if kind in ("target_verify", "draft_extend") else 1,
        layers=1 if kind.startswith("draft") else None,
        steps=3 if kind == "draft_decode" else 1,
        topk=2 if kind.startswith("draft") else 1,
    )


@pytest.mark.parametrize("kind", sorted(PHASE_KINDS))
def test_analytic_programs_are_typed_ops_and_flatten_round_trips(kind):
    prog = analytic_program(SMALL, _phase(kind), 8, backend("fa3"))
    ops = prog.prologue + prog.body + prog.epilogue
    assert ops and {type(op) for op in ops} == {Alloc, Free}
    assert all(op.size >= 0 for op in ops if isinstance(op, Alloc))
    events = prog.flatten()
    assert Program(prologue=ops_from_events(events)).flatten() == events


def test_runnable_is_the_allocators_compact_form_with_each_ids_kind():
    prog = Program(
        prologue=(Alloc(10, 0, "output"), Alloc(20, 1)),
        body=(Free(CARRY), Alloc(30, 2), Free(1)),
        repeats=2,
        epilogue=(Alloc(40, 3, "workspace"), Free(3)),
        carry_in=0,
        carry_out=2,
    )
    code = prog.runnable
    assert code.prologue == ((10, 0), (20, 1))
    assert code.body == ((FREE, CARRY), (30, 2), (FREE, 1))
    assert code.epilogue == ((40, 3), (FREE, 3))
    assert code.kinds == {0: "output", 1: "temp", 2: "temp", 3: "workspace"}
    assert (code.prologue_outputs, code.body_outputs, code.epilogue_outputs) == ({0}, set(), set())
    assert prog.runnable is code  # built once per program
    # PoolSim.run frees what a FREE pair names
    pool, live = PoolSim(), {}
    pool.run(code.prologue, live)
    pool.run(code.body[2:], live)
    assert sorted(live) == [0] and pool.allocated == 512


def test_without_workspace_drops_workspace_blocks_and_their_frees_only():
    prog = Program(
        prologue=(Alloc(1, 0), Alloc(2, 1, "workspace"), Free(1), Free(0)),
        body=(Alloc(3, 0, "workspace"), Alloc(4, 1), Free(0)),
        repeats=3,
        epilogue=(Alloc(5, 0, "output"),),
        carry_in=None,
        carry_out=1,
        carry_kind="output",
    )
    bare = prog.without_workspace()
    assert bare.prologue == (Alloc(1, 0), Free(0))
    assert bare.body == (Alloc(4, 1),)
    assert bare.epilogue == prog.epilogue
    assert (bare.repeats, bare.carry_in, bare.carry_out, bare.carry_kind) == (3, None, 1, "output")


def test_ops_from_events_keeps_ids_kinds_and_order():
    events = [
        Event(op="alloc", id=7, size=100, kind="library"),
        Event(op="alloc", id=3, size=5),
        Event(op="free", id=3),
    ]
    assert ops_from_events(events) == (Alloc(100, 7, "library"), Alloc(5, 3, "temp"), Free(3))
