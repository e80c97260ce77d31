"""The plan's answer to an engine's memory-profiling pass (adapters/profiling.py): the whole
capture's figure with its items, from a plan, its path, a runner carrying it, or a start-up
prediction; an unknown item says the figure is a lower bound."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_the_figure_is_the_plans_whole_capture_with_its_items(caplog):
    from capture_plan.adapters.profiling import profile_cudagraph_memory
    from capture_plan.executor import load_plan
    from capture_plan.schemas.keys import capture_memory

    path = ROOT / "plans/fa3-vllm.json"
    plan = load_plan(path, check_env=False)
    want = capture_memory(plan)
    caplog.set_level(logging.INFO, logger="capture_plan.adapters")

    class Runner:  # an engine's runner that carries its plan
        capture_plan = str(path)

    assert profile_cudagraph_memory(plan=plan) == profile_cudagraph_memory(Runner()) == want.bytes > 0
    assert want.bytes >= plan.predicted.pool_bytes
    text = caplog.records[0].getMessage()
    assert text.startswith(f"capture-plan: capture takes {want.bytes} B") and "pool " in text
    level = logging.INFO if want.complete else logging.WARNING
    assert caplog.records[0].levelno == level


def test_a_start_up_prediction_gives_its_measured_total(caplog):
    from capture_plan.adapters.profiling import profile_cudagraph_memory

    class Prediction:  # adapters.startup.StartupPrediction's fields the drop-in reads
        total_bytes = 123 << 20
        items = {"pool": 100 << 20, "graph-exec": 23 << 20}

    caplog.set_level(logging.INFO, logger="capture_plan.adapters")
    assert profile_cudagraph_memory(prediction=Prediction()) == 123 << 20
    assert "pool 104857600 B" in caplog.records[0].getMessage()


def test_no_plan_is_a_type_error_saying_what_to_pass():
    from capture_plan.adapters.profiling import profile_cudagraph_memory

    with pytest.raises(TypeError, match=r"no plan in object: pass plan="):
        profile_cudagraph_memory(object())
