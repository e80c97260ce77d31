"""The bounds of single fields are the schema types' msgspec constraints: one source
for what ``planner schema`` publishes and what the planner and executor refuse.

Every upper bound the published spec schema states (``maximum``, ``maxItems``,
``maxLength``) is read back from that schema and violated by one past it: the
planner must refuse exactly that field, located, naming the published bound; and
the bound itself is accepted. Plans and reports: every number is bounded below in
the published schema (the hand-written walk that refused negative numbers is
gone, so a number without a bound would be accepted negative).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import msgspec
import pytest

from capture_plan.planner.inputs.schema import json_schema
from capture_plan.planner.inputs.specs import model_presets
from capture_plan.planner.inputs.validate import decode_spec_sources, validate_spec
from capture_plan.schemas.codec import canonical_bytes, decode_plan, decode_report, decode_trace, plan_digest
from capture_plan.schemas.errors import InputError
from capture_plan.schemas.limits import (
    MAX_BS,
    MAX_EVENT_BYTES,
    MAX_PHASES,
    MAX_RULES,
    MAX_SIZES_PER_PHASE,
    MAX_TOKENS_PER_REQUEST,
    MODEL_MAX,
)
from capture_plan.schemas.spec import Phase, Spec
from reports import report_json

ROOT = Path(__file__).resolve().parents[1]
BASE = {"phases": [{"name": "decode", "kind": "decode", "sizes": [1, 2]}]}
#: where an instance of each spec struct sits in BASE with a draft_decode phase
#: appended (it accepts every phase setting: steps, topk, layers, model)
WHERE = {"Spec": (), "Model": ("model",), "Phase": ("phases", 1), "PhaseModel": ("phases", 1, "model")}
#: a valid item of each bounded list, to repeat one past its limit
ITEM = {"phases": BASE["phases"][0], "rules": {"id": "r", "why": "w"}, "sizes": 1, "after": "decode"}


def _schema(which: str) -> dict:
    return json.loads(json_schema(which))


def _decode(doc: dict):
    return decode_spec_sources(json.dumps(doc).encode(), "s.json", presets=model_presets())[0]


def _upper_bounds() -> list[tuple[str, str, str, object]]:
    """(struct, field, keyword, bound) of every upper bound in the published spec schema."""
    out = []
    for name, struct in _schema("spec")["$defs"].items():
        for field, prop in struct.get("properties", {}).items():
            for node in [prop, *prop.get("anyOf", ())]:
                for key in ("maximum", "maxItems", "maxLength"):
                    if key in node:
                        out.append((name, field, key, node[key]))
                for key in ("maximum", "maxLength"):  # each size's bound, each name's in `after`
                    if key in node.get("items", {}):
                        out.append((name, field, f"items.{key}", node["items"][key]))
    return out


def test_the_published_spec_schema_states_the_limits():
    defs = _schema("spec")["$defs"]
    sizes = defs["Phase"]["properties"]["sizes"]
    assert sizes["items"] == {"type": "integer", "minimum": 1, "maximum": MAX_BS}
    assert (sizes["minItems"], sizes["maxItems"]) == (1, MAX_SIZES_PER_PHASE)
    assert defs["Spec"]["properties"]["phases"]["maxItems"] == MAX_PHASES
    assert defs["Spec"]["properties"]["rules"]["maxItems"] == MAX_RULES
    for field, bound in MODEL_MAX.items():
        assert defs["Model"]["properties"][field]["maximum"] == bound, field
        assert defs["Model"]["properties"][field]["minimum"] == 1, field
    for field in ("tokens_per_request", "steps", "topk"):
        assert defs["Phase"]["properties"][field]["maximum"] == MAX_TOKENS_PER_REQUEST, field
    published = {(s, f) for s, f, *_ in _upper_bounds()}
    assert {
        ("Phase", "sizes"),
        ("Phase", "name"),
        ("Phase", "after"),
        ("Spec", "phases"),
        ("Spec", "rules"),
    } <= published
    event = _schema("trace")["$defs"]["Event"]
    assert event["prefixItems"][2]["maximum"] == MAX_EVENT_BYTES


def _bounds_ids():
    return [f"{s}.{f}:{k}" for s, f, k, _ in _upper_bounds()]


@pytest.mark.parametrize("struct,field,key,bound", _upper_bounds(), ids=_bounds_ids())
def test_each_published_bound_is_what_the_planner_refuses(struct, field, key, bound):
    assert struct in WHERE, f"a bounded struct this test does not place: {struct}"
    doc = copy.deepcopy(BASE)
    doc["phases"].append({"name": "draft", "kind": "draft_decode", "sizes": [1], "model": {"vocab": 32000}})
    parent = doc
    for k in WHERE[struct]:
        parent = parent.setdefault(k, {}) if isinstance(k, str) else parent[k]
    path = "$" + "".join(f".{k}" if isinstance(k, str) else f"[{k}]" for k in (*WHERE[struct], field))

    def at(n):
        if key == "maxItems":
            return [ITEM[field]] * n if field != "phases" else [{**ITEM["phases"], "name": f"p{i}"} for i in range(n)]
        if key == "maxLength":
            return "a" * n
        if key == "items.maximum":
            return [n]
        if key == "items.maxLength":
            return ["a" * n]
        return n

    if key in ("maxItems", "maxLength") or isinstance(bound, int):
        over, limit = at(bound + 1), str(bound)
    else:  # a float maximum (MiB)
        over, limit = at(bound * 2), repr(float(bound))
    parent[field] = over
    with pytest.raises(InputError) as err:
        _decode(doc)
    where = f"s.json: {path}[0]" if key.startswith("items.") else f"s.json: {path}"
    assert err.value.where == where
    assert f"over the limit of {limit}" in err.value.what, err.value
    assert err.value.fix
    # the bound itself is within the type (a rule over several fields may still refuse it:
    # kv_heads = 16384 does not divide heads = 32)
    parent[field] = at(bound)
    try:
        _decode(doc)
    except InputError as e:
        assert "over the limit" not in e.what, e


def test_a_size_past_the_limit_is_one_located_line_with_its_fix(cli, tmp_path):
    (tmp_path / "s.toml").write_text(f'[[phases]]\nname = "d"\nkind = "decode"\nsizes = [1, {MAX_BS + 1}]\n')
    code, out, err = cli("build", "-b", "fa3", "--spec", "s.toml")
    assert (code, out) == (1, "")
    assert err == (
        f"planner: error: s.toml: $.phases[0].sizes[1]: capture size {MAX_BS + 1} is over the limit of {MAX_BS}; "
        f"fix: capture sizes up to {MAX_BS}\n"
    )


def test_a_spec_built_in_code_is_held_to_the_types_bounds():
    """msgspec checks constraints when it decodes, not when a struct is built:
    validate_spec (the embedded specs) checks them all the same."""
    spec = Spec(phases=[Phase(name="d", kind="decode", sizes=[1, MAX_BS + 1], tokens_per_request=0)])
    with pytest.raises(InputError) as err:
        validate_spec(spec, "embedded")
    assert str(err.value).startswith("embedded: $.phases[0].sizes[1]: capture size")


def _numbers_without_lower_bound(schema: dict) -> list[str]:
    out = []

    def walk(node, where):
        if isinstance(node, dict):
            if node.get("type") in ("integer", "number") and "minimum" not in node and "exclusiveMinimum" not in node:
                out.append(where)
            for k, v in node.items():
                walk(v, f"{where}/{k}")
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, f"{where}/{i}")

    walk(schema, "#")
    return out


@pytest.mark.parametrize("which", ["plan", "report"])
def test_every_number_of_a_plan_or_report_is_bounded_below(which):
    assert _numbers_without_lower_bound(_schema(which)) == []


def test_a_negative_count_in_a_sealed_plan_is_located_by_its_type():
    raw = json.loads((ROOT / "plans/fa3-ci.json").read_bytes())
    raw["steps"][0]["runs"] = -3
    raw = {**raw, "digest": ""}
    raw["digest"] = plan_digest(raw)
    with pytest.raises(InputError) as err:
        decode_plan(canonical_bytes(raw), "p.json")
    assert str(err.value).startswith("p.json: $.steps[0].runs: Expected `int` >= 0, got -3; fix: rebuild the plan")
    # a dict's value has no exact path in msgspec's words: the message stays msgspec's
    raw["steps"][0]["runs"] = 0
    raw["predicted"]["pools"] = {"shared": -1}
    raw["digest"] = ""
    raw["digest"] = plan_digest(raw)
    with pytest.raises(InputError, match=r"p\.json: \$\.predicted\.pools\[\.\.\.\]: Expected `int` >= 0; fix"):
        decode_plan(canonical_bytes(raw), "p.json")


def test_trace_bounds_are_located_to_the_event_field():
    def trace(event) -> bytes:
        return msgspec.json.encode({"captures": [{"phase": "decode", "bs": 1, "events": [["alloc", 0, 1], event]}]})

    with pytest.raises(InputError) as err:
        decode_trace(trace(["alloc", 1, MAX_EVENT_BYTES + 1, "temp"]), "t.json")
    assert err.value.where == "t.json: $.captures[0].events[1][2]"
    assert err.value.what == f"allocation of {MAX_EVENT_BYTES + 1} bytes is over the limit of {MAX_EVENT_BYTES}"
    decode_trace(trace(["alloc", 1, MAX_EVENT_BYTES, "temp"]), "t.json")
    bs = msgspec.json.encode({"captures": [{"phase": "decode", "bs": MAX_BS + 1, "events": []}]})
    with pytest.raises(InputError, match=rf"t\.json: \$\.captures\[0\]\.bs: capture size {MAX_BS + 1} is over"):
        decode_trace(bs, "t.json")


_REPORT = report_json()


def test_report_seconds_are_bounded_by_the_type():
    rep = {**_REPORT, "capture_seconds": -1.0}
    with pytest.raises(InputError) as err:
        decode_report(json.dumps(rep).encode(), "r.json")
    assert err.value.where == "r.json: $.capture_seconds"
    assert err.value.what == "Expected `float` >= 0.0, got -1.0"


def test_a_device_item_given_back_during_capture_reads_back():
    """A device item is after - before: on the H200 a capture whose target freed a buffer
    meanwhile measured allocator-held at -31,236 bytes, and ``planner report`` refused the
    report the executor had just written. Signed, bounded by MAX_INT both ways."""
    items = [{"name": "pool", "bytes": 4096}, {"name": "allocator-held", "bytes": -31236}]
    view = {"free_before": 2, "free_after": 3, "drop": -1, "items": items}
    rep = {**_REPORT, "device_view": view}
    got = decode_report(json.dumps(rep).encode(), "r.json")
    assert got.device_view.item("allocator-held") == -31236 and got.device_view.drop == -1
    items[1]["bytes"] = -(2**53) - 1
    with pytest.raises(InputError) as err:
        decode_report(json.dumps(rep).encode(), "r.json")
    assert err.value.where == "r.json: $.device_view.items[1].bytes"
