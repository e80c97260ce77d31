"""Executor parts that run without a GPU: plan loading, fingerprints, dispatch."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from capture_plan.executor import (
    Environment,
    EnvironmentMismatch,
    ExecutorError,
    PadTable,
    check_environment,
    load_plan,
)
from capture_plan.planner import plan_bytes
from capture_plan.schemas.errors import InputError

H200 = Environment("NVIDIA H200", (9, 0), "2.11.0+cu130", frozenset({"fa3_fwd_interface", "torch"}))


@pytest.fixture
def plans(tmp_path, built) -> dict[str, Path]:
    """Fresh files for each test (tests edit them), the plans built once a session."""
    out = {}
    for name, kw in {"ci": dict(backend="fa3", ci=True), "dev": dict(backend="fa3")}.items():
        path = tmp_path / f"{name}.json"
        path.write_bytes(plan_bytes(built(**kw)))
        out[name] = path
    return out


def test_load_plan_accepts_a_fitting_machine(plans):
    plan = load_plan(plans["ci"], env=H200)
    assert plan.requires.modules == ["flash_attn_interface", "fa3_fwd_interface"]
    assert check_environment(plan, H200) == []


def test_mismatch_is_an_error_for_ci_plans_and_a_warning_otherwise(plans):
    a100 = Environment("NVIDIA A100", (8, 0), "2.3.0", frozenset({"torch"}))
    with pytest.raises(
        EnvironmentMismatch,
        match=r"ci.json: plan does not fit this machine: needs compute "
        r"capability >= 9.0, this is NVIDIA A100 \(8.0\); needs torch "
        r">=2.4, this is 2.3.0; backend fa3 kernels not importable",
    ):
        load_plan(plans["ci"], env=a100)
    with pytest.warns(UserWarning, match="plan does not fit this machine"):
        load_plan(plans["dev"], env=a100)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_plan(plans["dev"], env=H200)


def test_tampered_truncated_and_newer_plans(plans):
    path = plans["ci"]
    text = path.read_text()
    path.write_text(text.replace('"outputs": "view"', '"outputs": "keep"', 1))
    with pytest.raises(InputError, match="digest mismatch"):
        load_plan(path, env=H200)
    path.write_text(text[:-200])
    with pytest.raises(InputError, match="truncated or corrupted"):
        load_plan(path, env=H200)
    path.write_text(text.replace('"version": 1', '"version": 2', 1))
    with pytest.raises(InputError, match="newer than this capture-plan understands.*fix: upgrade capture-plan"):
        load_plan(path, env=H200)
    with pytest.raises(InputError, match="cannot read plan"):
        load_plan(path.with_name("nope.json"), env=H200)


def test_a_newer_revision_with_unknown_fields_still_loads(plans):
    import msgspec

    from capture_plan.schemas.codec import canonical_bytes, plan_digest

    raw = msgspec.json.decode(plans["ci"].read_bytes())
    raw["revision"] = 99
    raw["future_field"] = {"x": 1}
    raw["digest"] = plan_digest(raw)
    plans["ci"].write_bytes(canonical_bytes(raw))
    assert load_plan(plans["ci"], env=H200).revision == 99
    raw["future_field"] = {"x": 2}  # the digest covers fields this reader does not know
    plans["ci"].write_bytes(canonical_bytes(raw))
    with pytest.raises(InputError, match="digest mismatch"):
        load_plan(plans["ci"], env=H200)


def test_pad_table_dispatch():
    table = PadTable("decode", {1: "g1", 2: "g2", 4: "g4", 8: "g8", 24: "g24"})
    assert [table[n][0] for n in (1, 2, 3, 4, 5, 8, 9, 23, 24)] == [1, 2, 4, 4, 8, 8, 24, 24, 24]
    assert table[3][1] == "g4"
    for bad in (0, -1, 25, 10**6):
        with pytest.raises(ExecutorError, match=f"batch {bad} is outside the captured sizes 1..24"):
            table[bad]
