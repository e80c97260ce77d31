"""Graph keys (issue 28): a plan step captures a phase, a size and one label per variant
axis; step ids spell the key; the plan codec refuses keys that do not fit their phase."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from capture_plan.schemas.codec import canonical_bytes, decode_plan, plan_digest
from capture_plan.schemas.errors import InputError
from capture_plan.schemas.keys import (
    capture_memory,
    expand_labels,
    needed_revision,
    order_labels,
    step_id,
    uses_graph_keys,
)
from capture_plan.schemas.plan import PhasePlan, Strategy, VariantAxis

ROOT = Path(__file__).resolve().parents[1]


def _phase(**kw) -> PhasePlan:
    return PhasePlan(
        name="decode",
        kind="decode",
        sizes=[2, 1],
        tokens_per_request=1,
        output_lifetime="next-replay",
        strategy=Strategy(),
        pool="shared",
        **kw,
    )


def test_step_ids_spell_every_axis_in_declared_order():
    assert step_id("capture", "decode", 64) == "capture/decode/64"
    labels = (("lora", "nolora"), ("attention", "a"))
    assert step_id("capture", "decode", 64, labels) == "capture/decode/64/lora=nolora,attention=a"


def test_labels_expand_first_axis_outermost_in_label_order():
    combos = expand_labels([("lora", ["lora", "nolora"]), ("attention", ["a", "b"])])
    assert combos == [
        (("lora", "lora"), ("attention", "a")),
        (("lora", "lora"), ("attention", "b")),
        (("lora", "nolora"), ("attention", "a")),
        (("lora", "nolora"), ("attention", "b")),
    ]
    assert expand_labels([]) == [()]


def test_an_engine_call_is_put_in_the_phase_axis_order_and_checked():
    ph = _phase(variants=[VariantAxis(name="lora", labels=["lora", "nolora"]), VariantAxis(name="attn", labels=["a"])])
    assert order_labels(ph, {"attn": "a", "lora": "nolora"}) == (("lora", "nolora"), ("attn", "a"))
    with pytest.raises(ValueError, match="no variant axis 'tp'"):
        order_labels(ph, {"attn": "a", "lora": "nolora", "tp": "x"})
    with pytest.raises(ValueError, match="no label for 'attn'"):
        order_labels(ph, {"lora": "nolora"})
    with pytest.raises(ValueError, match=r"lora='dense' is not a label"):
        order_labels(ph, {"attn": "a", "lora": "dense"})
    with pytest.raises(ValueError, match="it has no variant axes"):
        order_labels(_phase(), {"lora": "lora"})


def _resealed(raw: dict) -> bytes:
    raw = {**raw, "digest": ""}
    raw["digest"] = plan_digest(raw)
    return canonical_bytes(raw)


def test_a_checked_in_plan_uses_no_graph_keys_and_stays_revision_2():
    plan = decode_plan((ROOT / "plans/fa3-ci.json").read_bytes(), "fa3-ci.json")
    assert not uses_graph_keys(plan)
    assert needed_revision(plan) == plan.revision == 2


def test_labels_on_a_phase_without_variants_are_refused_located():
    raw = json.loads((ROOT / "plans/fa3-ci.json").read_bytes())
    i = next(i for i, s in enumerate(raw["steps"]) if s["op"] == "capture")
    raw["steps"][i]["labels"] = ["lora"]
    with pytest.raises(InputError) as err:
        decode_plan(_resealed(raw), "p.json")
    assert err.value.where == f"p.json: $.steps[{i}].labels"
    assert "has no variant axes" in err.value.what


def test_a_profiling_pass_gets_the_whole_capture_with_its_items():
    plan = decode_plan((ROOT / "plans/fa3-ci-h200.json").read_bytes(), "p.json")
    mem = capture_memory(plan)
    assert plan.predicted.device is not None
    assert [i.name for i in mem.items] == [i.name for i in plan.predicted.device.items]
    known = [i.bytes for i in mem.items if i.bytes is not None]
    assert mem.bytes == (plan.predicted.device.total_bytes if mem.complete else sum(known))
    assert mem.bytes >= plan.predicted.pool_bytes
    assert msgspec.json.decode(msgspec.json.encode(mem))["items"][0]["name"] == "pool"
