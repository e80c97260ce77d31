"""Issue 50's target: following a build's options (and the build resolved from them, and its
capture sequence) from ``build_plan``, ``build_plan --sizes auto`` and ``choose_sizes`` returns
to a module it already left at most 4 times (bench/opts_walk.py says precisely what is followed
and counted; issue 39's bound was 8, and the size-choice walks were at 8 before issue 50).

Structural, not a timing: the count is the same on any machine."""

from __future__ import annotations

import pytest

from bench_modules import bench_module

opts_walk = bench_module("opts_walk")


def test_reentries_count_returns_to_a_module_left():
    assert opts_walk.reentries(["a", "b", "a", "c", "b"]) == 2
    assert opts_walk.reentries(["a", "a", "b", "b", "a"]) == 1  # consecutive calls in one module are one link
    assert opts_walk.reentries(["a", "b", "c"]) == 0


@pytest.fixture(scope="module")
def walks():
    return opts_walk.entries()


def test_walks_follow_the_options_into_the_pipeline(walks):
    """The walk is not empty by accident: it reaches the modules a build runs through."""
    for name in ("quickstart", "sizes_auto"):
        modules = {m for m, _ in walks[name].chain}
        assert {"planner/build.py", "planner/schedule/resolve.py", "planner/schedule/pipeline.py"} <= modules
    assert "planner/sizes/sizes.py" in {m for m, _ in walks["sizes_auto"].chain}
    assert walks["choose_sizes"].chain[0][0] == "planner/sizes/command.py"
    assert "planner/sizes/sizes.py" in {m for m, _ in walks["choose_sizes"].chain}


@pytest.mark.parametrize("entry", ["quickstart", "sizes_auto", "choose_sizes"])
def test_options_return_to_a_module_at_most_4_times(walks, entry):
    assert opts_walk.TARGET == 4
    w = walks[entry]
    assert w.reentries <= opts_walk.TARGET, opts_walk.show(w)


def test_the_size_choice_resolves_once_and_records_once(walks):
    """The size choice reads no input again (the spec, trace and reports are read once, by
    planner/schedule/read.py) and the plan's record of the options is made once, by resolve:
    the pipeline reads ``Resolved.record`` rather than recording the options again."""
    for name, w in walks.items():
        reads = [m for m, _ in w.chain if m == "planner/schedule/read.py"]
        assert len(reads) == 1, opts_walk.show(w)
        calls = [f for m, f, _ in w.calls if m == "planner/inputs/build_options.py"]
        assert calls.count("build_record") == 1, (name, calls)
        assert "normalized_command" not in calls, (name, calls)


def _helper(opts):
    return opts


def _gen(opts):
    yield 1
    _helper(opts)  # after the yield: still part of the walk
    yield 2


def _entry(opts):
    return list(_gen(opts))


def test_calls_a_generator_makes_after_a_yield_are_followed():
    """A generator "returns" at each yield (review finding: the walk dropped it there and lost
    the calls it made once resumed)."""
    from capture_plan.planner import BuildOptions

    w = opts_walk.walk("gen", _entry, BuildOptions(backend="fa3", ci=True))
    assert [name for _, name, _ in w.calls] == ["_entry", "_gen", "_helper"]


def test_the_walk_follows_the_capture_sequence(walks):
    """Issue 50: the build made of the resolved one (strategies and capture sequence) and the
    sequence itself are followed too; the Quickstart's walk returns to a module it left at
    most 4 times even so."""
    from capture_plan.planner.schedule.sequence import Build
    from capture_plan.schemas.capture_sequence import CaptureSequence

    assert {Build, CaptureSequence} <= set(opts_walk._tracked_types())
    functions = {f for _, fs in walks["quickstart"].chain for f in fs}
    assert {"_build", "build_steps"} <= functions  # build_steps receives the Build
    assert walks["quickstart"].reentries <= 4, opts_walk.show(walks["quickstart"])
