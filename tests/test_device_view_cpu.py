"""What capture leaves behind, on CPU with CUDA faked: warm-ups run in scratch
pools that are all returned, and the report's device view adds up."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from fake_cuda import Target, decode_plan  # noqa: E402

CPU = torch.device("cpu")


@pytest.mark.parametrize("backend", ["torch", "triton"])  # triton warms up at every size
def test_every_warmup_runs_in_a_scratch_pool_that_is_returned_and_no_capture_does(tmp_path, fake, backend):
    from capture_plan.executor import capture
    from capture_plan.planner import BuildOptions, build_plan

    spec = tmp_path / "spec.toml"
    spec.write_text('[[phases]]\nname = "decode"\nkind = "decode"\nsizes = [1, 2, 4, 8]\n')
    plan = build_plan(BuildOptions(backend=backend, spec=spec, strategies=("outputs=keep",)))
    target = Target(fake)
    gs = capture(plan, target, progress=False, device=CPU)
    runs = [(c[3], scratch) for c, scratch in zip(target.calls, target.scratch)]
    warmups = sum(s.runs for s in plan.steps if s.op == "warmup")
    assert sorted(runs).count((False, True)) == warmups >= 1  # every eager (warm-up) run: in a scratch pool
    assert (True, True) not in runs  # no capture records into one
    # one per warm-up step (the cuBLAS priming uses none: its operands would keep a segment);
    # all destroyed before capture() returns
    assert fake.mempools == sum(s.op == "warmup" for s in plan.steps) == fake.mempools_freed
    gs.release()


def test_device_view_items_add_up_to_the_free_memory_drop():
    from capture_plan.executor.device import Probe, device_view

    MiB = 2**20
    before = Probe(free=10_000 * MiB, reserved=100 * MiB, allocated=90 * MiB)
    # the pools: 258 MiB reserved, 200 allocated; the cuBLAS workspace 32 MiB held; 2 MiB cached;
    # 1 KiB hoisted; and 162 MiB outside the allocator
    after = Probe(
        free=before.free - (258 + 32 + 2 + 162) * MiB - 1024,
        reserved=before.reserved + (258 + 32 + 2) * MiB + 1024,
        allocated=before.allocated + (200 + 32) * MiB + 1024,
    )
    view = device_view(
        before,
        after,
        pool_reserved=258 * MiB,
        pool_allocated=200 * MiB,
        hoisted=1024,
        first_in_process=True,
        background=False,
    )
    assert {i.name: i.bytes for i in view.items} == {
        "pool": 258 * MiB,
        "hoisted": 1024,
        "allocator-held": 32 * MiB,
        "allocator-cached": 2 * MiB,
        "outside-allocator": 162 * MiB,
    }
    assert view.drop == sum(i.bytes for i in view.items) == before.free - after.free
    assert "first graph capture" in next(i.cause for i in view.items if i.name == "outside-allocator")


def test_only_the_first_capture_of_the_process_is_marked_first(tmp_path, fake):
    from capture_plan.executor import capture, session

    session._captured_in_process = False
    plan = decode_plan(tmp_path, [1, 2])
    first = capture(plan, Target(fake), progress=False, device=CPU)
    second = capture(plan, Target(fake), progress=False, device=CPU)
    assert first.report.device_view.first_in_process and not second.report.device_view.first_in_process
    assert all(m.free is not None for m in first.report.steps)
    first.release()
    second.release()
