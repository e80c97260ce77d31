"""The allocator simulation and the allocation programs it runs.

The allocator simulator: one hand-computed scenario per rule (planner/memory/allocator.py's docstring).

Allocation programs: typed ops, and the compact form the allocator runs."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from capture_plan.planner.inputs.resources import backend
from capture_plan.planner.memory.allocator import FREE, KiB, MiB, PoolSim, round_size, segment_size
from capture_plan.planner.memory.analytic import PHASE_KINDS, analytic_program
from capture_plan.planner.memory.program import CARRY, Alloc, Free, Program, ops_from_events
from capture_plan.schemas.spec import Model, Phase
from capture_plan.schemas.trace import Event


def test_rounding_to_512_byte_blocks():
    assert [round_size(n) for n in (0, 1, 511, 512, 513, 1000, 1024, 1025)] == [
        512,
        512,
        512,
        512,
        1024,
        1024,
        1024,
        1536,
    ]


def test_segment_sizes_small_large_and_huge():
    assert segment_size(512) == 2 * MiB  # small pool: 2 MiB segments
    assert segment_size(1 * MiB) == 2 * MiB  # 1 MiB inclusive is still small
    assert segment_size(1 * MiB + 512) == 20 * MiB  # large, under 10 MiB: 20 MiB
    assert segment_size(10 * MiB - 512) == 20 * MiB
    assert segment_size(10 * MiB) == 10 * MiB  # 10 MiB and up: rounded to 2 MiB
    assert segment_size(11 * MiB) == 12 * MiB


def test_new_segments_and_reserved_bytes():
    p = PoolSim()
    p.alloc(100)
    assert (p.reserved, p.allocated) == (2 * MiB, 512)
    p.alloc(3 * MiB)
    assert (p.reserved, p.segments) == (22 * MiB, 2)
    p.alloc(12 * MiB)  # fits the 17 MiB left of the 20 MiB segment: no new segment
    assert (p.reserved, p.segments) == (22 * MiB, 2)
    p.alloc(40 * MiB)
    assert p.reserved == 62 * MiB


def test_best_fit_takes_smallest_adequate_block_then_lowest_address():
    p = PoolSim()
    blocks = [p.alloc(s) for s in (4 * MiB, 2 * MiB, 3 * MiB, 2 * MiB, 2 * MiB)]  # one 20 MiB segment
    for b in (blocks[0], blocks[2]):  # free a 4 MiB and a 3 MiB hole
        p.free(b)
    got = p.alloc(3 * MiB - 4096)
    assert got.addr == blocks[2].addr  # the 3 MiB hole, not the 4 MiB one
    # two equal holes: the lowest address wins
    q = PoolSim()
    a, b, c, d = (q.alloc(2 * MiB) for _ in range(4))
    q.free(c)
    q.free(a)
    assert q.alloc(2 * MiB).addr == a.addr


def test_small_pool_split_threshold_is_512_bytes():
    p = PoolSim()
    first = p.alloc(1024)
    p.alloc(512)  # pin the rest of the segment away from `first`
    p.free(first)
    got = p.alloc(512)  # 1024 block, remainder 512 >= 512: split
    assert got.size == 512
    assert (512, got.addr + 512) in p.free_blocks(True)


def test_large_pool_splits_only_above_1_mib_remainder():
    p = PoolSim()
    big = p.alloc(4 * MiB)
    p.alloc(2 * MiB)  # neighbour, so `big`'s hole cannot merge
    p.free(big)
    got = p.alloc(3 * MiB)  # remainder exactly 1 MiB: not split, whole block handed out
    assert got.size == 4 * MiB
    p.free(got)
    got = p.alloc(3 * MiB - 512)  # remainder 1 MiB + 512: split
    assert got.size == 3 * MiB - 512


def test_free_merges_with_free_neighbours_in_the_same_segment():
    p = PoolSim()
    a, b, c = p.alloc(2 * MiB), p.alloc(2 * MiB), p.alloc(2 * MiB)
    p.free(a)
    p.free(c)
    p.free(b)  # merges with both neighbours and the segment's tail
    assert p.free_blocks(False) == [(20 * MiB, a.addr)]
    assert p.alloc(19 * MiB).addr == a.addr  # the merged block serves a large request


def test_blocks_freed_on_another_stream_are_not_reused():
    p = PoolSim()
    x = p.alloc(2 * MiB, stream=1)
    p.free(x)
    y = p.alloc(2 * MiB, stream=0)
    assert y.segment != x.segment
    assert p.reserved == 40 * MiB


def test_reserved_never_falls_after_frees():
    p = PoolSim()
    blocks = [p.alloc(s * MiB) for s in (30, 5, 1, 12)]
    top = p.reserved
    for b in blocks:
        p.free(b)
    assert p.reserved == top and p.allocated == 0


def test_expandable_segments_map_pages_on_demand():
    native, exp = PoolSim(), PoolSim(expandable=True)
    for pool in (native, exp):
        a = pool.alloc(30 * MiB)
        pool.free(a)
        pool.alloc(50 * MiB)  # native: a second segment; expandable: grow the one segment
    assert native.reserved == 80 * MiB
    assert exp.reserved == 60 * MiB  # 30 MiB rounded to 40 (20 MiB pages), grown to 60
    assert exp.segments == 1


def test_expandable_small_pool_uses_2_mib_pages():
    p = PoolSim(expandable=True)
    for _ in range(5):
        p.alloc(512 * KiB)
    assert p.reserved == 4 * MiB  # 2.5 MiB mapped as two 2 MiB pages
    assert p.segments == 1


def test_expandable_large_pool_splits_remainders_of_512_bytes():
    # should_split with expandable segments: remainder >= 512 B in the large
    # pool too, so the 0.5 MiB left of the first 20 MiB page stays free and
    # the next request grows the segment from there
    p = PoolSim(expandable=True)
    a = p.alloc(19 * MiB + 512 * KiB)
    assert a.size == 19 * MiB + 512 * KiB
    p.alloc(20 * MiB + 512 * KiB)  # 0.5 MiB free tail + one more 20 MiB page
    assert p.reserved == 40 * MiB and p.segments == 1
    native = PoolSim()
    assert native.alloc(19 * MiB + 512 * KiB).size == 20 * MiB  # native: 0.5 MiB <= 1 MiB, not split


def test_expandable_free_block_at_the_mapped_end_is_taken_last():
    # get_free_block ranks the free block before the unmapped space by its
    # size plus that space: a 6 MiB request takes the 10 MiB hole, not the
    # 8 MiB free tail, so a later 10 MiB request must map another page
    p = PoolSim(expandable=True)
    a = p.alloc(10 * MiB)
    p.alloc(2 * MiB)
    p.free(a)  # [10 free][2][8 free tail]
    assert p.alloc(6 * MiB).addr == a.addr
    p.alloc(10 * MiB)
    assert p.reserved == 40 * MiB
    # the tail is still used when nothing else fits
    q = PoolSim(expandable=True)
    b = q.alloc(4 * MiB)
    tail_addr = b.addr + 4 * MiB
    assert q.alloc(8 * MiB).addr == tail_addr and q.reserved == 20 * MiB


def test_expandable_segments_are_one_per_block_pool_and_stream():
    p = PoolSim(expandable=True)
    for size, stream in ((512, 0), (3 * MiB, 0), (700 * KiB, 0), (30 * MiB, 0), (512, 1), (2 * MiB, 1)):
        p.alloc(size, stream)
    assert sorted(p.segment_sizes()) == [(False, 20 * MiB), (False, 40 * MiB), (True, 2 * MiB), (True, 2 * MiB)]
    assert p.segments == 4 and p.reserved == 64 * MiB


def test_layout_lists_every_block_of_every_segment_by_address():
    p = PoolSim()
    a, b = p.alloc(3 * MiB), p.alloc(5 * MiB)
    p.alloc(100)
    p.free(a)
    assert p.layout() == [
        (False, 20 * MiB, ((3 * MiB, False), (5 * MiB, True), (12 * MiB, False))),
        (True, 2 * MiB, ((512, True), (2 * MiB - 512, False))),
    ]
    p.free(b)  # merges both ways: the head block changes
    assert p.layout()[0] == (False, 20 * MiB, ((20 * MiB, False),))


def test_segment_addresses_decide_ties_between_segments():
    def run(pool):
        a = pool.alloc(4 * MiB)  # segment 0: [a 4][16 free]
        c, d = pool.alloc(9 * MiB), pool.alloc(7 * MiB)
        pool.alloc(4 * MiB)  # segment 1: [4][16 free]
        pool.free(c)
        pool.free(d)  # both segments now [4][16 free]: a tie for 9 MiB
        pool.alloc(9 * MiB)  # takes the 16 MiB hole at the lower address
        pool.free(a)
        pool.alloc(18 * MiB)  # fits only where the 9 MiB did not go
        return pool.reserved

    assert run(PoolSim()) == 58 * MiB  # segment 0 lies lower: the 18 MiB needs its own segment
    assert run(PoolSim(addresses=iter([1 << 40, 1 << 32]))) == 40 * MiB  # segment 1 lower: segment 0 frees up


ops = st.lists(st.tuples(st.booleans(), st.integers(1, 48 * MiB), st.integers(0, 1)), min_size=1, max_size=60)


def _expected_choice(p, live, small, stream, size, expandable):
    """The block get_free_block picks, from the pool's free lists and the live blocks."""
    free = p.free_blocks(small, stream)
    cands = sorted((s, a) for s, a in free if s >= round_size(size))
    if not cands:
        return None
    if expandable:  # the free block at the mapped end (one segment per pool and stream) ranks last
        ends = [a + s for s, a in free] + [b.addr + b.size for b in live if b.small == small and b.stream == stream]
        if cands[0][0] + cands[0][1] == max(ends) and len(cands) > 1:
            return cands[1][1]
    return cands[0][1]


@settings(max_examples=200, deadline=None)
@given(ops, st.booleans())
def test_reserved_only_grows_and_best_fit_follows_get_free_block(seq, expandable):
    p = PoolSim(expandable=expandable)
    live = []
    last = 0
    for is_alloc, size, stream in seq:
        if is_alloc or not live:
            small = round_size(size) <= MiB
            want = _expected_choice(p, live, small, stream, size, expandable)
            b = p.alloc(size, stream)
            if want is not None:
                assert b.addr == want
            live.append(b)
        else:
            p.free(live.pop(size % len(live)))
        assert p.reserved >= last
        assert p.allocated <= p.reserved
        # the state signature is exactly the free lists (stream, size, addr each)
        small, large = p.free_lists()
        sig = p.free_state()
        assert sig[:2] == (p.reserved, p.allocated)
        assert [(k >> 128, k >> 64 & (2**64 - 1), k & (2**64 - 1)) for k in sig[2] + sig[3]] == list(small + large)
        # the layout accounts for every byte: segments tile into blocks, reserved is their sum
        layout = p.layout()
        assert sum(n for _, n, _ in layout) == p.reserved == sum(n for _, n in p.segment_sizes())
        assert all(n == sum(s for s, _ in blocks) for _, n, blocks in layout)
        assert sum(s for _, _, blocks in layout for s, used in blocks if used) == p.allocated
        last = p.reserved


@settings(max_examples=60, deadline=None)
@given(ops, ops, st.booleans())
def test_a_copy_continues_exactly_as_the_original_and_independently(first, then, expandable):
    """PoolSim.copy: the optimizer resumes simulations from copies taken after a prefix."""

    def play(p, seq, live):
        out = []
        for is_alloc, size, stream in seq:
            if is_alloc or not live:
                b = p.alloc(size, stream)
                live.append(b)
                out.append((b.addr, b.size))
            else:
                p.free(live.pop(size % len(live)))
        return out, p.layout(), p.free_state(), p.peak_reserved, p.peak_allocated

    a, b = PoolSim(expandable=expandable), PoolSim(expandable=expandable)
    live_a, live_b = [], []
    play(a, first, live_a)
    play(b, first, live_b)
    before = (a.layout(), a.free_state())
    twin = a.copy()
    # the copy's handles for the live blocks: same positions in its segments
    by_addr = {blk.addr: blk for blk in twin.blocks()}
    live_t = [by_addr[x.addr] for x in live_a]
    assert play(twin, then, live_t) == play(b, then, live_b)
    assert (a.layout(), a.free_state()) == before  # the original is untouched


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
