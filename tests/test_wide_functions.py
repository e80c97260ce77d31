"""Issue 50's target: no function in planner/ takes five or more arguments that are fields of
the resolved build or values computed from one. The build travels whole: ``Resolved``
(planner/schedule/resolve.py), ``Build`` and its ``CaptureSequence`` (planner/schedule/sequence.py),
``SpecRead`` (planner/schedule/read.py).

Whether an argument is a piece of the build is a reader's judgment, so this is a ledger: every
function in planner/ with five parameters or more (``self`` and ``cls`` not counted) is listed,
with why its parameters are not the build's pieces (:data:`NOT_THE_BUILD`), or as one that
still takes them (:data:`BUILD_IN_PIECES`, with what it waits for). A new wide function fails
here until it takes the build whole or is listed with its reason; one that is no longer wide
fails until its row goes.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: the fewest parameters that make a function wide
WIDE = 5

_CLI = "a click command: one parameter per command-line option, parsed into the options record"
_PROGRAM = "an analytic program's builder step: its ops, its shape (_Shape: the dimensions whole), the batch"
_FIT = "planner fit's own figures (its FitInputs whole, or the sizing rule's terms as the engine's code names them)"

#: wide functions whose parameters are not pieces of the resolved build, and why
NOT_THE_BUILD: dict[str, str] = {
    "planner/cli/_common.py:argument": "declares one CLI argument: the declaration's fields",
    "planner/cli/build.py:command": _CLI,
    "planner/cli/diff.py:command": _CLI,
    "planner/cli/fit.py:command": _CLI,
    "planner/cli/plot.py:command": _CLI,
    "planner/cli/sizes.py:command": _CLI,
    "planner/fit/estimate.py:activation_peak": _FIT,
    "planner/fit/estimate.py:eagle_profile_peak": _FIT,
    "planner/fit/result.py:plan_cost": _FIT,
    "planner/fit/sizing.py:vllm_draft_graphs": "a release's arithmetic over vLLM's own settings (the shared "
    "sizes, max_num_seqs, the speculative tokens) and two of its release facts",
    "planner/fit/estimate.py:graph_memory": _FIT,
    "planner/fit/estimate.py:sampler_phase": _FIT,
    "planner/fit/measured.py:calibration_graph": "a report read for planner fit: its path, the plan it must match",
    "planner/fit/result.py:graph_memory": _FIT,
    "planner/fit/rope.py:rotary_cache": "a model's rotary caches as one release keeps them: the model, the release "
    "(engine, version) and, for a speculative draft, the positions and dtype the engine runs it at",
    "planner/fit/result.py:fixes": _FIT,
    "planner/fit/result.py:result": _FIT,
    "planner/fit/reserve.py:reserve_growth_item": _FIT,
    "planner/fit/reserve.py:sizing_step_growth": _FIT,
    "planner/fit/reserve.py:sizing_step_requests": _FIT,
    "planner/fit/sizing.py:vllm_before_capture": _FIT,
    "planner/fit/sizing.py:vllm_after_capture": _FIT,
    "planner/fit/sizing.py:vllm_request_bytes": _FIT,
    "planner/fit/sizing.py:vllm_blocks": _FIT,
    "planner/fit/sizing.py:vllm_default_sizes": _FIT,
    "planner/fit/sizing.py:sglang_mem_fraction": _FIT,
    "planner/inputs/dimensions.py:resolve_model": "the spec's [model] table read, before any build is resolved",
    "planner/inputs/validate.py:_note_first": "a spec document's validation: a value and its error's location",
    "planner/inputs/validate.py:_check_phase_ref": "a spec document's validation: a reference and its error's location",
    "planner/memory/allocator.py:Block.__init__": "the simulator's block: its own fields (a linked-list node)",
    "planner/memory/allocator.py:PoolSim.run": "the simulator's loop: a program's ops and the run's state",
    "planner/memory/analytic.py:_rmsnorm": _PROGRAM,
    "planner/memory/analytic.py:_attention": _PROGRAM,
    "planner/memory/analytic.py:_decoder_layer": _PROGRAM,
    "planner/memory/analytic.py:_forward": _PROGRAM,
    "planner/memory/analytic.py:eagle_draft_program": "planner fit's EAGLE draft graph as an analytic program: "
    "the head's dimensions whole, one graph's shape (requests, tokens a request, steps), the backend, tp and the "
    "release's argmax",
    "planner/fit/graph_pool.py:_drafted": "one draft manager's graphs simulated, hashable for its cache: the "
    "head's model, the backend's name, tp, the graphs and the release's argmax",
    "planner/memory/analytic.py:forward_program": "planner fit's engine graph as an analytic program: "
    "the model's dimensions whole, a size, the backend, tp and what the graph holds besides its layers",
    "planner/memory/fitting.py:_Run._one": "a recorded trace's samples fitted: the trace's figures",
    "planner/memory/fitting.py:fit_phase": "a recorded trace's samples fitted: the trace's figures",
    "planner/memory/layers.py:_program": "a recorded trace's ops folded into a layer cycle",
    "planner/report/check.py:StalePlans.__init__": "a result's own fields",
    "planner/report/check.py:check_report_plan": "two documents (a report and a plan) and their names",
    "planner/report/compare.py:compare": "two plans and their names",
    "planner/report/plot.py:plot_plans": "plans and the plot's options",
    "planner/schedule/graph.py:StepGraph.add_step": "one step's coordinates (op, phase, size, labels) and its sort key",
    "planner/sizes/traffic.py:_parsed": "one parsed value and its error's location",
}

#: wide functions that still take the build's pieces, and what they wait for
BUILD_IN_PIECES: dict[str, str] = {
    "planner/memory/analytic.py:analytic_program": "model, backend and tp are the build's (its spec's model, "
    "backend, tp); its caller outside memory/ is planner/sizes/step_time.py's roofline",
    "planner/memory/analytic.py:analytic_capture": "as analytic_program (tests call it)",
}


def _wide(node: ast.AST, prefix: str = "") -> Iterator[str]:
    """Qualified names of the functions under ``node`` with :data:`WIDE` parameters or more."""
    for n in ast.iter_child_nodes(node):
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef):
            a = n.args
            params = [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs if p.arg not in ("self", "cls")]
            if len(params) >= WIDE:
                yield prefix + n.name
            yield from _wide(n, f"{prefix}{n.name}.")
        elif isinstance(n, ast.ClassDef):
            yield from _wide(n, f"{prefix}{n.name}.")
        else:
            yield from _wide(n, prefix)


def wide_functions() -> set[str]:
    return {
        f"{path.relative_to(ROOT).as_posix()}:{name}"
        for path in sorted((ROOT / "planner").rglob("*.py"))
        for name in _wide(ast.parse(path.read_text()))
    }


def test_the_ledger_counts_parameters_as_written():
    tree = ast.parse("def f(a, b, c, d): ...\nclass C:\n    def g(self, a, b, c, *, d, e): ...\n")
    assert list(_wide(tree)) == ["C.g"]


def test_every_wide_function_in_the_planner_is_in_the_ledger():
    found, listed = wide_functions(), set(NOT_THE_BUILD) | set(BUILD_IN_PIECES)
    assert not set(NOT_THE_BUILD) & set(BUILD_IN_PIECES)
    new, gone = sorted(found - listed), sorted(listed - found)
    assert not new, (
        f"{new} take {WIDE} arguments or more: take the resolved build whole (Resolved, Build, SpecRead, "
        "the CaptureSequence), or list each in tests/test_wide_functions.py with why its arguments "
        "are not the build's pieces"
    )
    assert not gone, f"{gone} are no longer wide: remove their rows from tests/test_wide_functions.py"


def test_no_function_of_the_build_route_takes_the_build_in_pieces():
    """The build's own route (resolve, read, the pipeline, the optimizer, the size choice, the
    device prediction) has none left; what remains lies outside it (BUILD_IN_PIECES)."""
    route = ("planner/schedule/", "planner/sizes/", "planner/build.py", "planner/memory/device.py")
    assert not [f for f in BUILD_IN_PIECES if f.startswith(route)]
