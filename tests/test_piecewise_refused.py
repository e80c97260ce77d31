"""The executor refuses to capture vLLM PIECEWISE phases as whole graphs (CPU, CUDA faked).

A piecewise phase's graphs are pieces between eagerly-run attention ops; the
plan predicts their pool for the engine's own piecewise backend. Before, the
executor captured each step as one whole graph: a different graph from the
one the plan describes, silently.
"""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parent.parent


class _Never:
    """A target that must not run: the refusal comes before any work."""

    def run(self, phase, bs, ws):
        raise AssertionError("ran")

    prepare = refresh = run


def test_capture_refuses_a_plan_with_a_piecewise_phase_before_any_work(fake):
    from capture_plan.executor import ExecutorError, capture, load_plan

    plan = load_plan(ROOT / "plans/fa3-vllm.json", check_env=False)
    assert [p.kind for p in plan.phases] == ["piecewise", "full"]
    with pytest.raises(ExecutorError, match=r"capture: phase 'piecewise' is 'piecewise'.*fix: capture piecewise"):
        capture(plan, _Never(), progress=False, device=torch.device("cpu"))
    assert fake.pools == 0


def test_the_engine_loop_refuses_a_piecewise_step_and_names_it(fake):
    from capture_plan.executor import ExecutorError, capture_loop, load_plan

    plan = load_plan(ROOT / "plans/fa3-vllm.json", check_env=False)
    with pytest.raises(ExecutorError, match=r"CaptureLoop.step: phase 'piecewise' is 'piecewise'"):
        with capture_loop(plan, device=torch.device("cpu")) as loop:
            loop.step("piecewise", loop.sizes("piecewise")[0])
    assert fake.pools == 0
