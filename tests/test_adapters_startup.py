"""The start-up prediction on CPU, from reports as the executor writes them: its driver
figure, the calibration cache across start-ups, confirm_startup."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from capture_plan.adapters.startup_figures import _driver  # noqa: E402
from capture_plan.executor.profiling import Recording  # noqa: E402
from capture_plan.planner import BuildOptions, build_plan  # noqa: E402
from capture_plan.planner.memory.device import calibration_from_report, pools_after  # noqa: E402
from capture_plan.schemas.report import CaptureReport, DeviceItem, DeviceView, StepMeasurement  # noqa: E402
from capture_plan.schemas.trace import CaptureTrace, Trace  # noqa: E402
from capture_plan.schemas.units import DRIVER_CHUNK  # noqa: E402
from reports import capture_report  # noqa: E402

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
                scratch=0,  # the warm-up's temporaries: measured by the executor
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
    return _report(plan, steps, view)


def _report(plan, steps: list[StepMeasurement], view: DeviceView) -> CaptureReport:
    """A capture report of ``plan`` on an H200 with these steps and device view."""
    return capture_report(
        plan, steps, device="NVIDIA H200 sm90, torch 2.11", capture_seconds=0.0, driver="580.1", device_view=view
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
    from capture_plan.planner.memory.device import per_node_figure

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


class _Stop(Exception):
    """Raised by a recording stubbed out with :func:`_stop_at_recording`."""


def _stop_at_recording(monkeypatch) -> dict:
    """Stub predict_startup's recording out: it keeps the schedule it was asked to record
    (``"schedule"``) and its keyword arguments in the dict returned, then raises _Stop;
    no GPU is read (the allocator's reserve reads 0)."""
    from capture_plan.adapters import startup

    seen: dict = {}

    def record(schedule, *a, **kw):
        seen.update(kw, schedule=schedule)
        raise _Stop

    monkeypatch.setattr(startup, "record", record)
    monkeypatch.setattr(startup, "_reserved_emptied", lambda device: 0)  # no GPU here
    return seen


def test_the_device_asked_for_is_the_one_recorded_on(monkeypatch, plan):
    """``predict_startup(device=...)`` was computed and then never used: the recording
    captured on the current device whatever the engine asked for."""
    import torch

    from capture_plan.adapters import startup

    seen = _stop_at_recording(monkeypatch)
    with pytest.raises(_Stop):
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
    from capture_plan.adapters.startup_figures import _peak, _timeline
    from capture_plan.planner.memory.device import pools_after

    after = pools_after(plan.steps, plan.predicted.timeline)
    driver = [0] * len(plan.steps)
    line = _timeline(plan, after, 0, 2 * MiB, driver)
    assert plan.steps[0].op == "warmup" and line[0] == after[0] == 0
    assert line[-1] == after[-1] + 2 * MiB
    scratch = {"decode": 10_000 * MiB}  # a warm-up far above the pools: the peak is that warm-up
    assert _peak(plan, {}, scratch, line) == 10_000 * MiB


def test_in_a_process_that_recorded_nothing_the_workspace_comes_with_the_first_warmup(plan):
    """A start-up from a cached calibration has not made the capture stream's workspace:
    the first warm-up's first GEMM makes it (32 MiB on the H200, there while the warm-up's
    temporaries are), so it is in that step and in the warm-up's peak."""
    from capture_plan.adapters.startup_figures import _peak, _timeline
    from capture_plan.planner.memory.device import pools_after

    after = pools_after(plan.steps, plan.predicted.timeline)
    line = _timeline(plan, after, 32 * MiB, 2 * MiB, [0] * len(plan.steps))
    assert line[0] == 32 * MiB and line[-1] == after[-1] + 34 * MiB
    scratch = {"decode": 10_000 * MiB}
    assert _peak(plan, {}, scratch, line) == 10_032 * MiB
    assert _peak(plan, {}, {}, line) is None  # a warm-up of unknown scratch: no peak, never a guess


def test_the_copies_count_every_graph_key_the_plan_captures(monkeypatch, tmp_path):
    """A phase with variant axes captures a graph per size and label combination: the
    copies must bring the phase to that many graphs. Counted by its sizes (5 here) they
    asked for none beyond the 12 graphs recorded, and 8 of the 20 the capture makes had
    no driver memory held for them (the copies not made shift later steps: copy_error's
    finding on the H200). With copy_error, a phase recorded whole needs no copies."""
    from capture_plan.adapters import startup

    spec = tmp_path / "s.toml"
    spec.write_text(
        '[[phases]]\nname = "decode"\nkind = "decode"\nsizes = [1, 2, 4, 8, 16]\n'
        'variants = { lora = ["lora", "nolora"], attention = ["b", "a"] }\n'
    )
    opts = BuildOptions(backend="fa3", spec=spec)
    keyed = build_plan(opts)
    seen = _stop_at_recording(monkeypatch)
    with pytest.raises(_Stop):
        startup.predict_startup(object(), opts, schedule=keyed)
    assert seen["instantiate"] == {"decode": 5 * 2 * 2}
    assert seen["instantiate"]["decode"] == sum(s.op == "capture" for s in keyed.steps)
    # with copy_error: a keyed phase recorded whole (every size, 20 graphs) needs no copies,
    # so the one other phase that does may stop its own early
    spec.write_text(spec.read_text() + '[[phases]]\nname = "verify"\nkind = "decode"\nsizes = [1, 2, 4, 8, 16]\n')
    two = build_plan(opts)
    seen.clear()
    with pytest.raises(_Stop):
        startup.predict_startup(object(), opts, schedule=two, sizes={"decode": [1, 2, 4, 8, 16]}, copy_error=2**20)
    assert seen["instantiate"] == {"decode": 20, "verify": 5} and seen["copy_error"] == 2**20


def test_a_given_schedule_is_recorded_from_and_none_is_built(monkeypatch, plan):
    """An engine's checked-in plan is the schedule: the analytic build (1.7 s for EAGLE's
    four phases) is skipped and the recording follows that plan."""
    from capture_plan.adapters import startup

    seen = _stop_at_recording(monkeypatch)

    def build(opts):
        raise AssertionError(f"built {opts}")

    monkeypatch.setattr(startup, "build_plan", build)
    with pytest.raises(_Stop):
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

    _stop_at_recording(monkeypatch)
    with pytest.raises(_Stop):
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


# -- the calibration cache across start-ups -------------------------------------------------
def _cached_startup(
    monkeypatch, plan, cache, *, model_key="llama bf16", recorded: list | None = None, fresh=True, **kw
):
    """``predict_startup`` with a cache, off CUDA: the recording is the report above (32 MiB
    held, 2 MiB cached outside the pools, copies for the whole plan), the process's first
    capture unless not ``fresh``; ``recorded`` collects each recording made."""
    import msgspec

    from capture_plan.adapters import startup

    rep = _recording(plan, held=32 * MiB, cached=2 * MiB)
    assert rep.device_view is not None
    view = msgspec.structs.replace(rep.device_view, first_in_process=fresh)
    rep = msgspec.structs.replace(rep, device_view=view)
    copies = {"decode": (33, 33 * 900, 33 * 2 * MiB)}

    def record(*a, **kw):
        if recorded is not None:
            recorded.append(1)
        return Recording(trace=_trace(rep), report=rep, copies=copies)

    monkeypatch.setattr(startup, "record", record)
    monkeypatch.setattr(startup, "build_plan", lambda opts: plan)
    return startup.predict_startup(
        object(),
        BuildOptions(backend="fa3", ci=True),
        schedule=plan,
        device="cpu",
        cache=cache,
        model_key=model_key,
        **kw,
    )


def test_a_later_start_up_reads_the_calibration_and_records_nothing(monkeypatch, plan, tmp_path):
    """The second start-up of the same model on the same device records nothing: its figures
    are a fresh process's (the driver holds no copies' memory; off CUDA nothing is primed,
    so the capture stream's workspace is still to take too), the first one's totals."""
    recorded: list = []
    first = _cached_startup(monkeypatch, plan, tmp_path / "cache", recorded=recorded)
    assert first.source == "recorded" and first.cache_path is not None and first.cache_path.is_file()
    later = _cached_startup(monkeypatch, plan, tmp_path / "cache", recorded=recorded)
    assert len(recorded) == 1, "the later start-up recorded"
    assert later.source == "cache" and later.cache_path == first.cache_path
    assert later.plan == first.plan and later.total_bytes == first.total_bytes and later.items == first.items
    assert later.recorded == first.recorded == {"decode": [1, 120, 256]}
    assert "record" not in later.timings and "cache" in later.timings
    after = pools_after(plan.steps, plan.predicted.timeline)
    assert later.timeline[0] == 32 * MiB  # the capture makes the capture stream's workspace first
    # the driver memory is all still to take, in whole chunks: the first start-up's copies held it
    assert later.timeline[-1] == after[-1] + 34 * MiB + later.items["graph-exec"]
    assert first.timeline[-1] < later.timeline[-1] and later.pending_bytes == later.total_bytes


def test_another_model_or_driver_records_again_and_says_what_differs(monkeypatch, plan, tmp_path, caplog):
    import logging

    from capture_plan.adapters import calibration_cache

    recorded: list = []
    _cached_startup(monkeypatch, plan, tmp_path, recorded=recorded)
    _cached_startup(monkeypatch, plan, tmp_path, model_key="llama fp8", recorded=recorded)
    assert len(recorded) == 2
    monkeypatch.setattr(calibration_cache, "driver_version", lambda: "999.1")
    with caplog.at_level(logging.INFO, logger="capture_plan.startup"):
        again = _cached_startup(monkeypatch, plan, tmp_path, recorded=recorded)
    assert len(recorded) == 3 and again.source == "recorded"
    assert "driver: the cache's is" in caplog.text and "this is '999.1'" in caplog.text
    assert len(list(tmp_path.glob("startup-*.json"))) == 3  # one entry per key, none overwritten


def test_an_unreadable_entry_is_recorded_over_never_a_failed_start_up(monkeypatch, plan, tmp_path, caplog):
    import logging

    first = _cached_startup(monkeypatch, plan, tmp_path)
    assert first.cache_path is not None
    first.cache_path.write_bytes(first.cache_path.read_bytes()[:100])  # truncated
    recorded: list = []
    with caplog.at_level(logging.WARNING, logger="capture_plan.startup"):
        again = _cached_startup(monkeypatch, plan, tmp_path, recorded=recorded)
    assert recorded and again.source == "recorded" and "unreadable" in caplog.text
    assert _cached_startup(monkeypatch, plan, tmp_path).source == "cache"  # written anew, whole


def test_an_entry_whose_key_or_plan_was_edited_is_not_reused(monkeypatch, plan, tmp_path, caplog):
    import logging

    import msgspec

    from capture_plan.schemas.codec import canonical_bytes
    from capture_plan.schemas.startup import StartupCalibration

    first = _cached_startup(monkeypatch, plan, tmp_path)
    assert first.cache_path is not None
    entry = msgspec.json.decode(first.cache_path.read_bytes(), type=StartupCalibration)
    forged = msgspec.structs.replace(entry, key={**entry.key, "torch": "1.0"})
    first.cache_path.write_bytes(canonical_bytes(forged))
    with caplog.at_level(logging.WARNING, logger="capture_plan.startup"):
        assert _cached_startup(monkeypatch, plan, tmp_path).source == "recorded"
    assert "torch: the cache's is '1.0'" in caplog.text
    caplog.clear()
    steps = list(entry.plan.steps)
    steps[0] = msgspec.structs.replace(steps[0], bs=steps[0].bs + 1)  # the plan edited, its digest not
    first.cache_path.write_bytes(
        canonical_bytes(msgspec.structs.replace(entry, plan=msgspec.structs.replace(entry.plan, steps=steps)))
    )
    with caplog.at_level(logging.WARNING, logger="capture_plan.startup"):
        assert _cached_startup(monkeypatch, plan, tmp_path).source == "recorded"
    assert "does not match its digest" in caplog.text


def test_a_cache_without_a_model_key_is_refused_before_recording(monkeypatch, plan, tmp_path):
    from capture_plan.schemas.errors import InputError

    recorded: list = []
    with pytest.raises(InputError, match="needs the model's key") as err:
        _cached_startup(monkeypatch, plan, tmp_path, model_key=None, recorded=recorded)
    assert not recorded and err.value.where == "predict_startup(cache=...)"


def _capture_report(plan, timeline: list[int], off: int = 0) -> CaptureReport:
    """The capture's report: each step took ``timeline``'s bytes, plus ``off`` from the
    first capture on."""
    before = 100_000 * MiB
    first = next(i for i, s in enumerate(plan.steps) if s.op == "capture")
    steps = [
        StepMeasurement(
            step=i,
            id=f"{s.op}/{s.phase}/{s.bs}",
            reserved=0,
            predicted_reserved=0,
            seconds=0.0,
            free=before - t - (off if i >= first else 0),
            allocator_reserved=0,
        )
        for i, (s, t) in enumerate(zip(plan.steps, timeline))
    ]
    free = steps[-1].free
    assert free is not None
    return _report(plan, steps, DeviceView(free_before=before, free_after=free, drop=before - free, items=[]))


def test_a_capture_as_predicted_keeps_the_entry(monkeypatch, plan, tmp_path):
    from capture_plan.adapters.startup import confirm_startup

    pred = _cached_startup(monkeypatch, plan, tmp_path)
    # the driver's late step: one 2 MiB step more than predicted from the first capture on
    check = confirm_startup(pred, _capture_report(plan, pred.timeline, off=2 * MiB))
    assert check.ok and check.within == check.steps == len(plan.steps) and not check.discarded
    assert pred.cache_path is not None and pred.cache_path.is_file()


def test_a_capture_that_contradicts_a_cached_prediction_drops_it(monkeypatch, plan, tmp_path, caplog):
    """A change the key cannot see (the engine's code, a kernel's scratch) shows in the
    capture: the entry goes, and the next start-up records again."""
    import logging

    from capture_plan.adapters.startup import confirm_startup

    _cached_startup(monkeypatch, plan, tmp_path)
    pred = _cached_startup(monkeypatch, plan, tmp_path)
    assert pred.source == "cache"
    with caplog.at_level(logging.WARNING, logger="capture_plan.startup"):
        check = confirm_startup(pred, _capture_report(plan, pred.timeline, off=8 * MiB))
    assert not check.ok and check.discarded and check.worst is not None
    step, predicted, measured = check.worst
    assert measured - predicted == 8 * MiB and step.startswith("capture/")
    assert "removed" in caplog.text and pred.cache_path is not None and not pred.cache_path.exists()
    recorded: list = []
    assert _cached_startup(monkeypatch, plan, tmp_path, recorded=recorded).source == "recorded" and recorded


def test_an_entry_written_again_since_it_was_read_is_kept_when_the_capture_contradicts_the_old_one(
    monkeypatch, plan, tmp_path, caplog
):
    """Two start-ups of one model: the second records again and writes its entry while the
    first is still capturing from the old one. The first's failed check removes only what it
    read, never the newer measurement."""
    import logging

    import msgspec

    from capture_plan.adapters.calibration_cache import CalibrationCache
    from capture_plan.adapters.startup import confirm_startup

    _cached_startup(monkeypatch, plan, tmp_path)
    pred = _cached_startup(monkeypatch, plan, tmp_path)
    assert pred.source == "cache" and pred.calibration is not None and pred.cache_path is not None
    newer = msgspec.structs.replace(pred.calibration, allocator_other=pred.calibration.allocator_other + 8 * MiB)
    assert CalibrationCache(tmp_path).store(newer) == pred.cache_path
    with caplog.at_level(logging.INFO, logger="capture_plan.startup"):
        check = confirm_startup(pred, _capture_report(plan, pred.timeline, off=8 * MiB))
    assert not check.ok and not check.discarded and "written again since it was read: kept" in caplog.text
    assert _cached_startup(monkeypatch, plan, tmp_path).calibration == newer


def test_the_key_names_the_spec_by_content_not_by_path(plan, tmp_path):
    """An engine that writes its spec to a new folder at every start-up keys the same build;
    another spec's phases do not."""
    import torch

    from capture_plan.adapters.calibration_cache import calibration_key

    cpu = torch.device("cpu")
    text = '[[phases]]\nname = "decode"\nkind = "decode"\nsizes = [1, 120, 256]\n'
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "s.toml").write_text(text)
    (tmp_path / "c.toml").write_text(text.replace("120", "128"))
    a = calibration_key("m", plan, BuildOptions(backend="fa3", spec=tmp_path / "a" / "s.toml"), cpu)
    assert calibration_key("m", plan, BuildOptions(backend="fa3", spec=tmp_path / "b" / "s.toml"), cpu) == a
    c = calibration_key("m", plan, BuildOptions(backend="fa3", spec=tmp_path / "c.toml"), cpu)
    assert {k for k in a if a[k] != c[k]} == {"options"}
    traced = BuildOptions(backend="fa3", spec=tmp_path / "a" / "s.toml", trace=tmp_path / "t.json")
    assert calibration_key("m", plan, traced, cpu) == a  # the trace is the recording's
    assert calibration_key("m", plan, BuildOptions(backend="fa3", ci=True), cpu)["options"] != a["options"]


def test_the_code_part_of_the_key_changes_with_a_module_or_data_table_never_with_bytecode(
    monkeypatch, tmp_path, request
):
    """A changed planner under the same version records again: an edited module or a new
    data table of the packages that make or read a calibration changes the key's code
    part; Python writing bytecode next to them (every start-up may) does not."""
    import os

    import capture_plan.adapters
    import capture_plan.executor
    import capture_plan.planner
    import capture_plan.schemas
    from capture_plan.adapters import calibration_cache

    request.addfinalizer(calibration_cache._code_identity.cache_clear)  # the real packages' again for later tests
    for pkg in (capture_plan.schemas, capture_plan.planner, capture_plan.executor, capture_plan.adapters):
        root = tmp_path / pkg.__name__.rsplit(".", 1)[1]
        (root / "memory").mkdir(parents=True)
        (root / "__init__.py").write_text("")
        (root / "memory" / "fit.py").write_text("x = 1\n")
        monkeypatch.setattr(pkg, "__file__", str(root / "__init__.py"))

    def code() -> str:
        calibration_cache._code_identity.cache_clear()
        return calibration_cache._code_identity()

    first = code()
    assert code() == first
    cache = tmp_path / "planner" / "memory" / "__pycache__"
    cache.mkdir()
    (cache / "fit.cpython-312.pyc").write_bytes(b"bytecode")
    assert code() == first
    (tmp_path / "planner" / "memory" / "table.toml").write_text("[a]\n")
    with_table = code()
    assert with_table != first
    fit = tmp_path / "executor" / "memory" / "fit.py"
    fit.write_text("x = 2\n")  # same size: the modification time tells
    os.utime(fit, ns=(1, 1))
    assert code() != with_table


def test_a_capture_that_took_less_in_between_but_the_same_in_the_end_holds(monkeypatch, plan, tmp_path):
    """In a process that recorded nothing, the driver takes the graphs' memory a 2 MiB step
    or two later than their nodes say, then catches up (measured on an H200): steps
    predicted high are on the safe side, and the entry stays."""
    from capture_plan.adapters.startup import confirm_startup

    pred = _cached_startup(monkeypatch, plan, tmp_path)
    lagging = [t - 4 * MiB if 0 < i < len(pred.timeline) - 1 else t for i, t in enumerate(pred.timeline)]
    check = confirm_startup(pred, _capture_report(plan, lagging))
    assert check.ok and check.above == 0 and check.within < check.steps and not check.discarded
    assert check.final == (pred.timeline[-1], pred.timeline[-1])
    low_total = [t - 4 * MiB if i else t for i, t in enumerate(pred.timeline)]  # the total predicted 4 MiB high
    assert not confirm_startup(pred, _capture_report(plan, low_total)).ok


def test_the_workspace_is_taken_from_the_first_step_even_a_provision():
    """The executor makes the capture stream's workspace when the capture opens, before a
    provision step allocates a hoisted workspace (EAGLE's plan starts with one): predicted
    0 there, it measured 32 MiB on an H200."""
    from capture_plan.adapters.startup_figures import _timeline

    eagle = build_plan(BuildOptions(backend="fa3", ci=True, speculative="eagle"))
    assert eagle.steps[0].op == "provision"
    after = pools_after(eagle.steps, eagle.predicted.timeline)
    line = _timeline(eagle, after, 32 * MiB, 2 * MiB, [0] * len(eagle.steps))
    assert line[0] == after[0] + 32 * MiB


def test_a_start_up_from_the_cache_leaves_the_process_as_a_recording_would(monkeypatch):
    """A process's first stream makes torch's pool of streams (70 MiB on an H200, taken
    before the capture reads free memory) and its first GEMM initializes cuBLAS (66 MiB,
    in a process whose eager run made none): a recording pays both, and a cached start-up
    must too, with the capture stream's workspace, before the engine sizes its KV cache.
    What the priming reserved is what it made."""
    import torch

    from capture_plan.adapters import startup

    made, reserved = [], iter([100 * MiB, 132 * MiB, 132 * MiB, 132 * MiB])
    monkeypatch.setattr(startup, "capture_stream", lambda d: ("stream", d))
    monkeypatch.setattr(startup, "prime_stream", lambda d, s: made.append((d, s)))
    monkeypatch.setattr(startup, "_reserved_emptied", lambda d: next(reserved))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert startup._as_recorded(None) == 32 * MiB
    assert startup._as_recorded(torch.device("cuda", 1)) == 0  # primed before: nothing made now
    assert startup._as_recorded(torch.device("cpu")) == 0
    cuda0, cuda1 = torch.device("cuda", 0), torch.device("cuda", 1)
    assert made == [(cuda0, ("stream", cuda0)), (cuda1, ("stream", cuda1))]


def test_of_the_allocator_memory_the_recording_held_only_the_workspace_made_now_is_not_pending(
    monkeypatch, plan, tmp_path
):
    """Qwen2's recording held 33 MiB outside the pools: the 32 MiB workspace and 1 MiB the
    model makes at its capture and keeps. A cached start-up makes the workspace when it
    primes the capture stream; the model's 1 MiB is still to come (it was predicted 3 MiB
    low, 1 MiB of it this, on an H200)."""
    from capture_plan.adapters import startup

    _cached_startup(monkeypatch, plan, tmp_path)
    monkeypatch.setattr(startup, "_as_recorded", lambda device: 31 * MiB)
    later = _cached_startup(monkeypatch, plan, tmp_path)
    assert later.source == "cache" and later.items["stream-workspace"] == 32 * MiB
    after = pools_after(plan.steps, plan.predicted.timeline)
    assert later.timeline[0] == after[0] + 1 * MiB


def test_a_recording_in_a_process_that_captured_before_is_not_kept(monkeypatch, plan, tmp_path, caplog):
    """The driver reuses the memory of graphs a process released: a recording after an
    earlier capture measures little or no driver memory, and a fresh process reading that
    would predict the graphs' memory short. Such a recording predicts for now, and is not
    written."""
    import logging

    with caplog.at_level(logging.INFO, logger="capture_plan.startup"):
        pred = _cached_startup(monkeypatch, plan, tmp_path, fresh=False)
    assert pred.source == "recorded" and pred.cache_path is None
    assert not list(tmp_path.glob("startup-*.json")) and "had captured graphs before" in caplog.text


def test_a_cache_folder_that_cannot_be_written_loses_nothing_but_the_entry(monkeypatch, plan, tmp_path, caplog):
    import logging

    folder = tmp_path / "cache"
    folder.write_text("a file where the folder should be")
    with caplog.at_level(logging.WARNING, logger="capture_plan.startup"):
        pred = _cached_startup(monkeypatch, plan, folder)
    assert pred.source == "recorded" and pred.cache_path is None and pred.timeline
    assert "not written" in caplog.text


def test_an_entry_whose_figures_do_not_cover_the_plan_is_not_reused(monkeypatch, plan, tmp_path, caplog):
    import logging

    import msgspec

    from capture_plan.schemas.codec import canonical_bytes
    from capture_plan.schemas.startup import StartupCalibration

    first = _cached_startup(monkeypatch, plan, tmp_path)
    assert first.cache_path is not None
    entry = msgspec.json.decode(first.cache_path.read_bytes(), type=StartupCalibration)
    assert entry.driver is not None
    first.cache_path.write_bytes(canonical_bytes(msgspec.structs.replace(entry, driver=entry.driver[:3])))
    with caplog.at_level(logging.WARNING, logger="capture_plan.startup"):
        assert _cached_startup(monkeypatch, plan, tmp_path).source == "recorded"
    assert f"cover 3 of the plan's {len(plan.steps)} steps" in caplog.text


def test_the_allocators_configuration_is_part_of_the_key(monkeypatch, plan):
    import torch

    from capture_plan.adapters.calibration_cache import calibration_key

    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    opts, cpu = BuildOptions(backend="fa3", ci=True), torch.device("cpu")
    plain = calibration_key("m", plan, opts, cpu)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    other = calibration_key("m", plan, opts, cpu)
    assert {k for k in plain if plain[k] != other[k]} == {"environment"}
    assert other["environment"] == "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"


def test_a_backends_compiled_library_rebuilt_in_place_changes_the_key(monkeypatch, plan, tmp_path):
    """FA3's interface is a ``.py`` that imports its kernels from another package's
    extension module (``fa3_fwd_interface`` imports ``fa3_fwd._C``); rebuilt in place
    (``pip install -e``), only the library changes, and the key must see it."""
    import importlib
    import sys
    import types

    import msgspec
    import torch

    from capture_plan.adapters.calibration_cache import calibration_key

    (tmp_path / "fake_kernels_iface.py").write_text("import fake_kernels._C\n")
    lib = tmp_path / "fake_kernels" / "_C.abi3.so"
    lib.parent.mkdir()
    lib.write_bytes(b"kernels v1")
    package, ext = types.ModuleType("fake_kernels"), types.ModuleType("fake_kernels._C")
    ext.__file__ = str(lib)  # an extension module as the import system leaves it (never loaded here)
    package._C = ext  # pyright: ignore[reportAttributeAccessIssue]
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(sys.modules, "fake_kernels", package)
    monkeypatch.setitem(sys.modules, "fake_kernels._C", ext)
    importlib.invalidate_caches()
    iface = importlib.import_module("fake_kernels_iface")  # imported as an engine would
    del sys.modules["fake_kernels_iface"]
    monkeypatch.setitem(sys.modules, "fake_kernels_iface", iface)  # and gone after the test
    schedule = msgspec.structs.replace(
        plan, requires=msgspec.structs.replace(plan.requires, modules=["fake_kernels_iface"])
    )
    opts, cpu = BuildOptions(backend="fa3", ci=True), torch.device("cpu")
    before = calibration_key("m", schedule, opts, cpu)
    assert "fake_kernels._C 10 bytes" in before["backend"]
    assert calibration_key("m", schedule, opts, cpu) == before
    lib.write_bytes(b"kernels v2, rebuilt")
    after = calibration_key("m", schedule, opts, cpu)
    assert {k for k in before if before[k] != after[k]} == {"backend"}


def test_a_figure_below_what_the_capture_took_holds_only_within_a_driver_step(monkeypatch, plan, tmp_path):
    """Below what the capture took is the unsafe side (the KV cache was sized from it):
    0.5% or one 2 MiB step. Above, 1% or 2 MiB."""
    from capture_plan.adapters.startup import confirm_startup

    pred = _cached_startup(monkeypatch, plan, tmp_path)
    end = len(pred.timeline) - 1
    off = 5 * MiB // 2
    low = [t - off if i == end else t for i, t in enumerate(pred.timeline)]  # final predicted 2.5 MiB high
    high = [t + off if i == end else t for i, t in enumerate(pred.timeline)]  # 2.5 MiB low
    assert 250 * MiB < pred.timeline[-1] < 400 * MiB  # 1% is above 2.5 MiB, 0.5% below 2 MiB
    assert confirm_startup(pred, _capture_report(plan, low)).ok
    check = confirm_startup(pred, _capture_report(plan, high))
    assert not check.ok and check.above == 1 and check.discarded


def test_without_per_step_figures_the_peak_and_the_final_figure_are_compared(monkeypatch, plan, tmp_path):
    """A prediction per graph has no timeline: its peak (a warm-up above the final figure)
    is not compared with the final drop."""
    import dataclasses

    from capture_plan.adapters.startup import confirm_startup

    pred = _cached_startup(monkeypatch, plan, tmp_path)
    bare = dataclasses.replace(pred, timeline=[], pending_bytes=500 * MiB)  # the warm-up, above the final figure
    rep = _capture_report(plan, pred.timeline)
    steps = [msgspec_replace(m, scratch=500 * MiB) if m.id.startswith("warmup/") else m for m in rep.steps]
    check = confirm_startup(bare, msgspec_replace(rep, steps=steps))
    assert check.ok and check.steps == 0 and check.final == (pred.final_bytes, pred.timeline[-1])


@pytest.mark.parametrize("wrong", ["background", "plan"])
def test_a_report_of_another_capture_is_refused(monkeypatch, plan, tmp_path, wrong):
    from capture_plan.adapters.startup import confirm_startup
    from capture_plan.schemas.errors import InputError

    pred = _cached_startup(monkeypatch, plan, tmp_path)
    rep = _capture_report(plan, pred.timeline)
    assert rep.device_view is not None
    if wrong == "background":
        rep = msgspec_replace(rep, device_view=msgspec_replace(rep.device_view, background=True))
    else:
        rep = msgspec_replace(rep, plan_digest="sha256:" + "0" * 64)
    with pytest.raises(InputError, match="background capture" if wrong == "background" else "the report is of plan"):
        confirm_startup(pred, rep)
    assert pred.cache_path is not None and pred.cache_path.is_file()  # nothing judged, nothing removed


def msgspec_replace(obj, **kw):
    import msgspec

    return msgspec.structs.replace(obj, **kw)


def test_copies_stop_where_the_per_node_figure_settles_and_the_reason_is_kept():
    """profiling._settles: the copies' done test stops once the copies left are bounded
    within the budget, records why; with a driver that jumps it makes every copy."""
    import math

    from capture_plan.executor.node_bytes import STEP
    from capture_plan.executor.profiling import _settles

    nodes = {"n": 0}

    def taken_now():
        return STEP * math.ceil((5000 + 2900 * nodes["n"]) / STEP) - STEP

    settled: dict[str, str] = {}
    done = _settles("decode", 48, 650, 1 * MiB, taken_now, settled)
    assert done is not None
    made = 0
    while made < 48:
        made += 1
        nodes["n"] += 650
        if done(made, nodes["n"]):
            break
    assert made < 48 and settled["decode"].startswith(f"{made} of 48 copies")
    # a driver that took a block unrelated to nodes at the 4th copy: every copy made, no reason
    jumpy: dict[str, str] = {}
    nodes["n"] = 0

    def jump() -> int:
        return 2900 * nodes["n"] + (64 * MiB if nodes["n"] > 2600 else 0)

    done = _settles("decode", 48, 650, 1 * MiB, jump, jumpy)
    assert done is not None
    stops = []
    for made in range(1, 49):
        nodes["n"] += 650
        stops.append(done(made, nodes["n"]))
    assert not any(stops) and not jumpy
    assert _settles("decode", 48, 0, 1 * MiB, taken_now, {}) is None  # nodes not countable: every copy


def test_a_phase_whose_copies_settled_early_keeps_the_measured_figure_and_holds_what_was_taken(plan):
    rep = _recording(plan)
    cal = calibration_from_report(rep, "rec", {"decode": "decode"})
    made, taken = 20, 20 * 900 * 3000
    rec = Recording(
        trace=_trace(rep),
        report=rep,
        copies={"decode": (made, made * 900, taken)},
        settled={"decode": "20 of 33 copies: stable"},
    )
    driver, held, how = _driver(plan, [cal], rec)
    assert driver is not None
    assert held == 3 * 2 * MiB + taken  # only what the copies made took is held now
    per_node = held / (23 * 900)
    assert driver[-1] == -(-round(36 * 900 * per_node) // DRIVER_CHUNK) * DRIVER_CHUNK
    assert driver[-1] - held > 10 * DRIVER_CHUNK  # the capture takes the rest, as predicted
    assert "copies stopped early: decode 20 of 33 copies: stable" in how
    # the same copies without the settled reason: refused, the device table's figure as before
    bare = Recording(trace=_trace(rep), report=rep, copies={"decode": (made, made * 900, taken)})
    assert "devices.toml" in _driver(plan, [cal], bare)[2]


def test_the_prediction_names_its_shortcuts_and_passes_the_copy_budget(monkeypatch, plan):
    import torch

    from capture_plan.adapters import startup
    from capture_plan.adapters.startup_figures import COPY_ERROR

    rep = _recording(plan)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    seen: list = []

    def record(*a, copy_error=None, **kw):
        seen.append(copy_error)
        settled = {"decode": "20 of 33 copies: stable"} if copy_error is not None else {}
        made = 20 if copy_error is not None else 33
        return Recording(
            trace=_trace(rep), report=rep, copies={"decode": (made, made * 900, made * 900 * 3000)}, settled=settled
        )

    monkeypatch.setattr(startup, "record", record)
    monkeypatch.setattr(startup, "build_plan", lambda opts: plan)
    opts = BuildOptions(backend="fa3", ci=True)
    pred = startup.predict_startup(object(), opts, schedule=plan, copy_error=COPY_ERROR)
    assert seen == [COPY_ERROR]  # one phase: the whole budget
    assert pred.shortcuts == {"copies:decode": "20 of 33 copies: stable"}
    assert "write" in pred.timings
    assert pred.allocator_core.split()[0] in ("compiled", "python")  # what the build ran on
    # the default makes every copy: a budget was measured to break exactness on the H200
    whole = startup.predict_startup(object(), opts, schedule=plan)
    assert seen[-1] is None and whole.shortcuts == {}
    assert "stopped early" not in whole.graph_exec


def test_the_recording_times_its_steps_from_the_report(plan):
    """profiling._step_seconds: the recorded capture's time split into its warm-ups, its
    graphs and the rest, from the report's steps."""
    import msgspec

    from capture_plan.executor.profiling import _step_seconds

    rep = _recording(plan)
    steps = [msgspec.structs.replace(m, seconds=0.5 if m.id.startswith("warmup/") else 0.1) for m in rep.steps]
    rep = msgspec.structs.replace(rep, steps=steps, capture_seconds=1.0)
    got = _step_seconds(rep)
    assert got["capture.warmup"] == 0.5 and abs(got["capture.graphs"] - 0.3) < 1e-9
    assert abs(got["capture.other"] - 0.2) < 1e-9
    assert _step_seconds(None) == {}


def test_the_copy_budget_applies_to_one_phase_needing_copies_and_is_refused_for_more():
    from capture_plan.adapters.startup_figures import COPY_ERROR, copy_budget

    one = {"decode": 51}
    assert copy_budget(one, {"decode": 3}, COPY_ERROR) == (COPY_ERROR, "")
    assert copy_budget(one, {"decode": 3}, None) == (None, "")
    eagle = {p: 57 for p in ("decode", "draft_decode", "draft_extend", "target_verify")}
    budget, why = copy_budget(eagle, {p: 3 for p in eagle}, COPY_ERROR)
    assert budget is None and why.startswith("every copy made: 4 phases need copies")
    # phases recorded whole need no copies: the one left may stop early
    whole = {p: 57 for p in eagle if p != "decode"} | {"decode": 3}
    assert copy_budget(eagle, whole, COPY_ERROR) == (COPY_ERROR, "")


def test_the_public_face_is_the_startup_module():
    """Engines import the prediction and its check from adapters.startup (docs/executor.md):
    the same objects as their homes'."""
    from capture_plan.adapters import startup, startup_check, startup_figures

    assert startup.confirm_startup is startup_check.confirm_startup
    assert startup.measured_peak is startup_check.measured_peak
    assert startup.StartupCheck is startup_check.StartupCheck
    assert startup.StartupPrediction is startup_figures.StartupPrediction
    assert set(startup.__all__) <= set(vars(startup))


def test_the_first_rounds_copies_run_beside_the_build_and_are_awaited_before_the_device_is_read(plan, monkeypatch):
    """predict_startup asks the first recording for its copies in the background, builds
    the plan from the trace meanwhile, and waits for them (and the graphs' release) before
    it reads the allocator again or records another round."""
    from capture_plan.adapters import startup

    rep = _recording(plan)
    order: list[str] = []

    class Pending:
        def join(self):
            order.append("copies done")

    def record(*a, background=False, **kw):
        order.append(f"record background={background}")
        return Recording(
            trace=_trace(rep), report=rep, copies={"decode": (33, 33 * 900, 33 * 900 * 3000)}, _pending=Pending()
        )

    def build(opts):
        order.append("build")
        return plan

    monkeypatch.setattr(startup, "record", record)
    monkeypatch.setattr(startup, "build_plan", build)
    monkeypatch.setattr(startup, "_reserved_emptied", lambda device: order.append("allocator read") or 0)
    pred = startup.predict_startup(object(), BuildOptions(backend="fa3", ci=True), schedule=plan)
    assert order == ["allocator read", "record background=True", "build", "copies done", "allocator read"]
    assert "record.copies.waited" in pred.timings


def test_background_copies_run_on_their_own_thread_and_their_error_reaches_the_caller():
    """executor.profiling._Background: the work runs on another thread while the caller goes
    on; join() re-raises what it raised and puts the switch interval back."""
    import sys
    import threading

    from capture_plan.executor.profiling import _Background

    before = sys.getswitchinterval()
    seen: list = []
    go = threading.Event()
    bg = _Background(lambda: (go.wait(5), seen.append(threading.current_thread().name)))
    assert sys.getswitchinterval() <= _Background.SWITCH_INTERVAL  # the copier gets the GIL back quickly
    go.set()  # the caller went on: the work waited for it
    bg.join()
    assert seen == ["capture-plan-copies"] and sys.getswitchinterval() == before

    def fail():
        raise RuntimeError("cuGraphInstantiate refused")

    bg = _Background(fail)
    with pytest.raises(RuntimeError, match="refused"):
        bg.join()
    assert sys.getswitchinterval() == before


def test_overlapping_background_copies_put_the_switch_interval_back_once_the_last_is_joined():
    """Two recordings' copies in flight at once (review finding: the first join put back the
    lowered interval the second had saved); a failed one re-raises at every join."""
    import sys
    import threading

    from capture_plan.executor.profiling import _Background

    before = sys.getswitchinterval()
    go = threading.Event()
    first, second = _Background(lambda: go.wait(5)), _Background(lambda: go.wait(5))
    go.set()
    first.join()
    assert sys.getswitchinterval() <= _Background.SWITCH_INTERVAL  # the second still copies
    second.join()
    assert sys.getswitchinterval() == before

    def fail():
        raise RuntimeError("cuGraphInstantiate refused")

    bg = _Background(fail)
    for _ in range(2):  # a second wait() does not pass over the failure
        with pytest.raises(RuntimeError, match="refused"):
            bg.join()
    assert sys.getswitchinterval() == before


def test_a_failed_build_is_the_error_seen_when_the_copies_fail_too(plan, monkeypatch, caplog):
    """predict_startup: the build raised and the background copies failed as well: the
    build's error propagates (the copies' is logged), and the copies were awaited."""
    from capture_plan.adapters import startup

    rep = _recording(plan)
    waited: list[bool] = []

    class Pending:
        def join(self):
            waited.append(True)
            raise RuntimeError("copies failed")

    monkeypatch.setattr(
        startup, "record", lambda *a, **kw: Recording(trace=_trace(rep), report=rep, _pending=Pending())
    )

    def build(opts):
        raise ValueError("the build failed")

    monkeypatch.setattr(startup, "build_plan", build)
    monkeypatch.setattr(startup, "_reserved_emptied", lambda device: 0)
    with pytest.raises(ValueError, match="the build failed"):
        startup.predict_startup(object(), BuildOptions(backend="fa3", ci=True), schedule=plan)
    assert waited == [True] and "copies failed too" in caplog.text
