"""The start-up prediction's driver figure on CPU, from reports as the executor writes them."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from capture_plan.adapters.startup import _driver  # noqa: E402
from capture_plan.executor.profiling import Recording  # noqa: E402
from capture_plan.planner import BuildOptions, build_plan  # noqa: E402
from capture_plan.planner.device import DRIVER_CHUNK, calibration_from_report, pools_after  # noqa: E402
from capture_plan.schemas.report import CaptureReport, DeviceItem, DeviceView, StepMeasurement  # noqa: E402
from capture_plan.schemas.trace import CaptureTrace, Trace  # noqa: E402

MiB = 2**20


@pytest.fixture(scope="module")
def plan():
    return build_plan(BuildOptions(backend="fa3", ci=True))


def _recording(
    plan, sizes=(1, 120, 256), nodes: int | None = 900, per_graph=2 * MiB, held=0, cached=0
) -> CaptureReport:
    """The recording's report: a warm-up, then a capture of each size whose instantiation
    took ``per_graph`` driver bytes and counted ``nodes`` nodes; ``held`` and ``cached``
    bytes grown in the allocator outside the pools."""
    free, steps = (
        100_000 * MiB,
        [
            StepMeasurement(
                step=0,
                id="warmup/decode/256",
                reserved=0,
                predicted_reserved=0,
                seconds=0.0,
                free=100_000 * MiB,
                allocator_reserved=0,
            )
        ],
    )
    for i, bs in enumerate(sizes, 1):
        free -= per_graph
        steps.append(
            StepMeasurement(
                step=i,
                id=f"capture/decode/{bs}",
                reserved=0,
                predicted_reserved=0,
                seconds=0.0,
                free=free,
                allocator_reserved=0,
                graph_nodes=nodes,
            )
        )
    items = [DeviceItem(name=n, bytes=0) for n in ("pool", "hoisted")]
    items += [DeviceItem(name="allocator-held", bytes=held), DeviceItem(name="allocator-cached", bytes=cached)]
    items.append(DeviceItem(name="outside-allocator", bytes=len(sizes) * per_graph))
    view = DeviceView(free_before=100_000 * MiB, free_after=free, drop=100_000 * MiB - free, items=items)
    return CaptureReport(
        plan=plan.name,
        plan_digest=plan.digest,
        device="NVIDIA H200 sm90, torch 2.11",
        torch="2.11",
        backend_module="",
        pool_bytes=0,
        predicted_pool_bytes=0,
        capture_seconds=0.0,
        steps=steps,
        driver="580.1",
        device_view=view,
    )


def _trace(rep: CaptureReport) -> Trace:
    """The recording's trace: one capture per capture step of ``rep`` (events left out)."""
    caps = [m.id.split("/") for m in rep.steps if m.id.startswith("capture/")]
    captures = [CaptureTrace(phase=ph, bs=int(bs), events=[]) for _, ph, bs in caps]
    return Trace(device="", backend="fa3", captures=captures)


def test_the_driver_memory_of_the_whole_capture_is_what_the_copies_took_and_is_held_now(plan):
    rep = _recording(plan)
    cal = calibration_from_report(rep, "rec", {"decode": "decode"})
    copies = len(plan.phases[0].sizes) - 3
    taken = copies * 900 * 3000  # 3,000 B a node, as the copies measured it
    rec = Recording(trace=_trace(rep), report=rep, copies={"decode": (copies, copies * 900, taken)})
    driver, held, how = _driver(plan, [cal], rec)
    assert driver is not None and len(driver) == len(plan.steps)
    assert held == 3 * 2 * MiB + taken  # the recorded graphs' and the copies': the driver keeps both
    per_node = held / (36 * 900)
    assert driver[-1] == -(-round(36 * 900 * per_node) // DRIVER_CHUNK) * DRIVER_CHUNK
    assert 0 <= driver[-1] - held < DRIVER_CHUNK  # the capture itself takes at most one more chunk
    assert "instantiated 33 times more" in how and f"decode {per_node:.0f}" in how


def test_without_copies_the_device_tables_figure_and_the_recorded_graphs_are_held(plan):
    from capture_plan.planner.device import per_node_figure

    rep = _recording(plan)
    cal = calibration_from_report(rep, "rec", {"decode": "decode"})
    bare = Recording(trace=_trace(rep), report=rep, copies={})
    driver, held, how = _driver(plan, [cal], bare)
    listed = per_node_figure("sm90")
    assert driver is not None and listed is not None
    assert held == -(-round(3 * 900 * listed) // DRIVER_CHUNK) * DRIVER_CHUNK
    assert driver[-1] == -(-round(36 * 900 * listed) // DRIVER_CHUNK) * DRIVER_CHUNK
    assert "devices.toml" in how


def test_a_phase_the_recording_counted_no_nodes_of_has_no_node_figure(plan):
    rep = _recording(plan, nodes=None)  # an engine's own graphs: not counted
    cal = calibration_from_report(rep, "rec", {"decode": "decode"})
    bare = Recording(trace=_trace(rep), report=rep, copies={})
    assert _driver(plan, [cal], bare) == (None, 0, "")


def test_the_device_asked_for_is_the_one_recorded_on(monkeypatch, plan):
    """``predict_startup(device=...)`` was computed and then never used: the recording
    captured on the current device whatever the engine asked for."""
    import torch

    from capture_plan.adapters import startup

    seen = {}

    class Stop(Exception):
        pass

    def record(*a, **kw):
        seen.update(kw)
        raise Stop

    monkeypatch.setattr(startup, "record", record)
    monkeypatch.setattr(startup, "_reserved_emptied", lambda device: 0)  # no GPU here
    with pytest.raises(Stop):
        startup.predict_startup(object(), BuildOptions(backend="fa3", ci=True), device="cuda:1")
    assert seen["device"] == torch.device("cuda:1")


def test_a_phase_recorded_whole_needs_no_copies_and_keeps_its_measured_figure(tmp_path):
    """A phase of three sizes is recorded whole: no copy is needed, and its own graphs
    measure its bytes a node (it used to fall back to the device table then)."""
    spec = tmp_path / "s.toml"
    spec.write_text('[[phases]]\nname = "decode"\nkind = "decode"\nsizes = [1, 120, 256]\n')
    small = build_plan(BuildOptions(backend="fa3", spec=spec))
    rep = _recording(small)
    cal = calibration_from_report(rep, "rec", {"decode": "decode"})
    rec = Recording(trace=_trace(rep), report=rep, copies={"decode": (0, 0, 0)})
    driver, held, how = _driver(small, [cal], rec)
    assert held == 3 * 2 * MiB and driver is not None and driver[-1] == 3 * 2 * MiB
    assert "devices.toml" not in how and f"decode {2 * MiB / 900:.0f}" in how


def test_a_warmup_before_the_first_capture_does_not_carry_the_rng_segment(plan):
    """The RNG state's segment comes with the first capture: the peak of a warm-up before
    it is its scratch alone (it was counted there too, 2 MiB high on the H200)."""
    from capture_plan.adapters.startup import _peak, _timeline
    from capture_plan.planner.device import pools_after

    after = pools_after(plan.steps, plan.predicted.timeline)
    driver = [0] * len(plan.steps)
    line = _timeline(plan, after, 2 * MiB, driver)
    assert plan.steps[0].op == "warmup" and line[0] == after[0] == 0
    assert line[-1] == after[-1] + 2 * MiB
    scratch = {"decode": 10_000 * MiB}  # a warm-up far above the pools: the peak is that warm-up
    assert _peak(plan, after, {}, scratch, line) == 10_000 * MiB


def test_a_given_schedule_is_recorded_from_and_none_is_built(monkeypatch, plan):
    """An engine's checked-in plan is the schedule: the analytic build (1.7 s for EAGLE's
    four phases) is skipped and the recording follows that plan."""
    from capture_plan.adapters import startup

    seen = {}

    class Stop(Exception):
        pass

    def record(schedule, *a, **kw):
        seen["schedule"] = schedule
        raise Stop

    def build(opts):
        raise AssertionError(f"built {opts}")

    monkeypatch.setattr(startup, "record", record)
    monkeypatch.setattr(startup, "build_plan", build)
    with pytest.raises(Stop):
        startup.predict_startup(object(), BuildOptions(backend="fa3", ci=True), schedule=plan)
    assert seen["schedule"] is plan


@pytest.mark.parametrize("backend", ["fa3", "triton"])
def test_a_schedule_of_another_build_is_refused_before_recording(monkeypatch, plan, tmp_path, backend):
    """Checked against the options' spec before anything is recorded: a schedule of other
    sizes made the fitter ask for sizes the schedule does not plan, and the next round
    failed in subset_plan with a bare ValueError."""
    from capture_plan.adapters import startup
    from capture_plan.schemas.errors import InputError

    spec = tmp_path / "s.toml"
    spec.write_text('[[phases]]\nname = "decode"\nkind = "decode"\nsizes = [1, 120, 256]\n')
    other = build_plan(BuildOptions(backend=backend, spec=spec)) if backend == "fa3" else plan

    def record(*a, **kw):
        raise AssertionError("recorded")

    monkeypatch.setattr(startup, "record", record)
    options = BuildOptions(backend="fa3" if backend == "fa3" else "triton", ci=True)
    with pytest.raises(InputError, match=r"the schedule .* is fa3: decode \((3|36) sizes\).*is \w+: decode") as err:
        startup.predict_startup(object(), options, schedule=other)
    assert err.value.where == "predict_startup(schedule=...)"


def test_a_schedule_of_the_same_build_is_accepted(monkeypatch, plan):
    from capture_plan.adapters import startup

    class Stop(Exception):
        pass

    def record(*a, **kw):
        raise Stop

    monkeypatch.setattr(startup, "record", record)
    monkeypatch.setattr(startup, "_reserved_emptied", lambda device: 0)
    with pytest.raises(Stop):
        startup.predict_startup(object(), BuildOptions(backend="fa3", ci=True), schedule=plan)


@pytest.mark.parametrize(("kept", "again"), [(32 * MiB, 3 * MiB), (35 * MiB, 0), (-5 * MiB, 35 * MiB)])
def test_allocator_memory_the_recording_left_reserved_is_not_taken_again(monkeypatch, plan, kept, again):
    """The recording grew the allocator by 32 MiB held (the capture stream's workspace) and
    3 MiB cached outside the pools. What of it stays reserved once the recording released
    its graphs is not taken again: on an H200 a Qwen2-MoE model kept it all and the
    prediction, which assumed the cached part was made again, was 3 MiB high at 16 steps.
    A target that freed memory it held before reads as less than nothing kept: never more
    is taken again than the recording grew."""
    import torch

    from capture_plan.adapters import startup

    rep = _recording(plan, sizes=(1, 120, 256), held=32 * MiB, cached=3 * MiB)
    reserved = iter([1000 * MiB, 1000 * MiB + kept])
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: next(reserved))
    copies = {"decode": (33, 33 * 900, 33 * 2 * MiB)}
    monkeypatch.setattr(startup, "record", lambda *a, **kw: Recording(trace=_trace(rep), report=rep, copies=copies))
    monkeypatch.setattr(startup, "build_plan", lambda opts: plan)
    pred = startup.predict_startup(object(), BuildOptions(backend="fa3", ci=True), schedule=plan)
    assert pred.items["stream-workspace"] == 32 * MiB and pred.items["allocator-other"] == 3 * MiB
    # no driver memory pending (the copies took it); the first capture adds what is taken again
    first = next(i for i, s in enumerate(plan.steps) if s.op == "capture")
    after = pools_after(plan.steps, plan.predicted.timeline)
    assert pred.timeline[first] - after[first] == again
    assert pred.timeline[-1] == after[-1] + again


def test_the_sizes_the_fitter_names_are_recorded_in_the_next_round(monkeypatch, plan):
    """The fitter's refusal carries its phase and sizes (RecordMoreError), which the next
    round records beside the first round's; the message is never parsed."""
    from capture_plan.adapters import startup
    from capture_plan.schemas.errors import RecordMoreError

    rep = _recording(plan)
    seen: list[dict] = []

    def record(schedule, target, *, sizes, **kw):
        seen.append(sizes)
        return Recording(trace=_trace(rep), report=rep)

    def build(opts):
        if len(seen) == 1:
            raise RecordMoreError("fits disagree", phase="decode", sizes=[40], fix="a message not parsed")
        return plan

    monkeypatch.setattr(startup, "record", record)
    monkeypatch.setattr(startup, "build_plan", build)
    pred = startup.predict_startup(object(), BuildOptions(backend="fa3", ci=True), schedule=plan)
    assert seen == [{"decode": [1, 120, 256]}, {"decode": [1, 40, 120, 256]}]
    assert pred.recorded == {"decode": [1, 40, 120, 256]}


def test_rounds_that_never_give_every_size_name_the_phase_and_the_fitters_reason(monkeypatch, plan):
    from capture_plan.adapters import startup
    from capture_plan.schemas.errors import InputError, RecordMoreError

    rep = _recording(plan)
    monkeypatch.setattr(startup, "record", lambda *a, **kw: Recording(trace=_trace(rep), report=rep))
    monkeypatch.setattr(startup, "_reserved_emptied", lambda device: 0)
    asked = iter([[40], [48], [56]])

    def build(opts):
        raise RecordMoreError("fits disagree at bs 40", phase="decode", sizes=next(asked))

    monkeypatch.setattr(startup, "build_plan", build)
    with pytest.raises(InputError, match=r"phase 'decode': .* after 3 rounds \(fits disagree") as err:
        startup.predict_startup(object(), BuildOptions(backend="fa3", ci=True), schedule=plan, max_rounds=3)
    assert isinstance(err.value.__cause__, RecordMoreError)
