"""Plans, traces and reports as files: decoding, the seal, validation, and the one
located line the CLI gives for a bad one.

Nothing a file holds crashes, fools or hangs the planner (issue 9): corrupt,
truncated, tampered, newer, nested too deep, sealed but inconsistent, numbers out
of range, the wrong kind of file."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from capture_plan.schemas.codec import decode_plan
from capture_plan.schemas.errors import InputError
from capture_plan.schemas.report import StepMeasurement
from cli_inputs import SPEC, one_line_error, reseal
from reports import report_json

ROOT = Path(__file__).resolve().parents[1]


def test_deeply_nested_traces_reports_and_plans_are_one_located_line(cli, tmp_path, plan_raw):
    deep = "[" * 1000 + "]" * 1000
    (tmp_path / "d.json").write_text('{"captures": ' + deep + "}")
    (tmp_path / "s.toml").write_text(SPEC)
    one_line_error(cli("build", "-b", "fa3", "--spec", "s.toml", "--trace", "d.json"), "d.json")
    one_line_error(cli("report", "d.json"), "d.json")
    (tmp_path / "p.json").write_bytes(reseal({**plan_raw, "extra": json.loads("[" * 200 + "]" * 200)}))
    one_line_error(cli("show", "p.json"), "p.json", "nested deeper than 64")
    (tmp_path / "p.json").write_text('{"version": 1, "steps": ' + deep + ', "command": []}')
    one_line_error(cli("show", "p.json"), "p.json")


def _mutations(raw: dict):
    steps = raw["steps"]
    yield (
        "timeline shorter",
        {"predicted": {**raw["predicted"], "timeline": raw["predicted"]["timeline"][:-1]}},
        "$.predicted.timeline",
    )
    yield (
        "edge to unknown",
        {"edges": raw["edges"] + [{"src": steps[0]["id"], "dst": "capture/x/1", "rule": "r"}]},
        "$.edges[",
    )
    yield "unknown phase", {"steps": [{**steps[0], "phase": "nope"}] + steps[1:]}, "$.steps[0].phase"
    yield "bs 0", {"steps": [{**steps[0], "bs": 0}] + steps[1:]}, "$.steps[0].bs"
    yield "negative bytes", {"steps": [{**steps[0], "bytes": -1}] + steps[1:]}, "$.steps[0].bytes"
    yield "duplicate id", {"steps": steps + [{**steps[-1], "index": len(steps)}]}, "$.steps["
    yield "tp 0", {"requires": {**raw["requires"], "tp": 0}}, "$.requires.tp"
    yield "negative pool", {"predicted": {**raw["predicted"], "pool_bytes": -5}}, "$.predicted.pool_bytes"
    yield "index", {"steps": [{**steps[0], "index": 7}] + steps[1:]}, "$.steps[0].index"
    # issue 18, fault 2: captures that no longer match the phases one-to-one
    yield from _capture_mutations(raw)


def _capture_mutations(raw: dict):
    """Edits after which the digest was recomputed but the captures no longer
    match the phases' sizes one-to-one (the executor found out mid-capture:
    "size 1 was already added")."""
    steps = raw["steps"]
    caps = [i for i, s in enumerate(steps) if s["op"] == "capture"]
    a, b = caps[0], caps[1]
    phase = steps[a]["phase"]

    def edit(i: int, **fields) -> list[dict]:
        return [({**s, **fields} if j == i else s) for j, s in enumerate(steps)]

    # two captures of one size, none of another (id, size and phase all edited to match)
    yield "captured twice", {"steps": edit(b, phase=phase, bs=steps[a]["bs"], id=steps[a]["id"])}, f"$.steps[{b}].id"
    # the size edited, the id left: the id lies
    yield "size changed, id kept", {"steps": edit(b, phase=phase, bs=steps[a]["bs"])}, f"$.steps[{b}].id"
    # the largest size turned into a warm-up (its id too): never captured, so refused at replay
    largest = max((i for i in caps if steps[i]["phase"] == phase), key=lambda i: steps[i]["bs"])
    bs = steps[largest]["bs"]
    yield (
        "largest turned into a warm-up",
        {"steps": edit(largest, op="warmup", runs=1, pool="", outputs=None, id=f"warmup/{phase}/{bs}")},
        "$.steps[",
    )
    # ... and without a warm-up of that size already there: the phase's size is never captured
    others = [s for s in steps if not (s["phase"] == phase and s["bs"] == bs)]
    others = [{**s, "index": i} for i, s in enumerate(others)]
    yield (
        "largest dropped",
        {
            "steps": others,
            "edges": [],
            "predicted": {
                **raw["predicted"],
                "timeline": [{**m, "step": i} for i, m in enumerate(raw["predicted"]["timeline"][: len(others)])],
            },
        },
        f"$.phases[{[p['name'] for p in raw['phases']].index(phase)}].sizes",
    )
    # a size listed twice in a phase
    sizes = raw["phases"][0]["sizes"]
    yield (
        "size listed twice",
        {"phases": [{**raw["phases"][0], "sizes": sizes + sizes[:1]}] + raw["phases"][1:]},
        f"$.phases[0].sizes[{len(sizes)}]",
    )
    # an id naming another op
    wi = next(i for i, s in enumerate(steps) if s["op"] == "warmup")
    yield (
        "id names another op",
        {"steps": edit(wi, id=steps[wi]["id"].replace("warmup/", "provision/"))},
        f"$.steps[{wi}].id",
    )


@pytest.mark.parametrize("command", ["show", "graph", "simulate", "explain"])
def test_sealed_but_inconsistent_plans_are_refused(cli, tmp_path, plan_raw, command):
    for _label, change, where in _mutations(plan_raw):
        (tmp_path / "p.json").write_bytes(reseal({**plan_raw, **change}))
        one_line_error(cli(command, "p.json"), f"p.json: {where}")


def test_load_plan_rejects_sealed_but_inconsistent_plans(tmp_path, plan_raw):
    from capture_plan.executor.load import load_plan

    for _label, change, where in _mutations(plan_raw):
        (tmp_path / "p.json").write_bytes(reseal({**plan_raw, **change}))
        with pytest.raises(InputError, match=f"p.json: {where[:12]}".replace("$", r"\$").replace("[", r"\[")):
            load_plan(tmp_path / "p.json", check_env=False)


@pytest.mark.parametrize(
    "trace,needle",
    [
        ('{"backend": "triton", "captures": []}', "t.json: $.backend: trace was recorded with backend 'triton'"),
        ('{"version": -1, "captures": []}', "t.json: $.version: trace version -1"),
        (
            '{"captures": [{"phase": "decode", "bs": 1, "events": [["alloc", 0, 1' + "0" * 300 + ', "temp"]]}]}',
            "t.json: $.captures[0].events[0]",
        ),
        ('{"captures": [], "captures": []}', "duplicate key 'captures'"),
        # issue 18, fault 3: the trace is decoded typed now; duplicates in captures and nesting still refused
        ('{"captures": [{"phase": "decode", "bs": 1, "bs": 2, "events": []}]}', "t.json: duplicate key 'bs'"),
        ('{"captures": [{"phase": "decode", "bs": 1, "\\u0062s": 2, "events": []}]}', "t.json: duplicate key 'bs'"),
        (
            '{"captures": [{"phase": "decode", "bs": 1, "events": [["alloc", 0, 1, "temp"]], '
            '"events": [["alloc", 0, 1, "temp"]]}]}',
            "t.json: duplicate key 'events'",
        ),
        ('{"device": ' + "[" * 5000 + "]" * 5000 + ', "captures": []}', "t.json: nested deeper than 64 levels"),
        ('[["alloc", 0, 1, "temp"]]', "t.json: $: a trace must be a JSON object (a TOML table), got an array"),
        ('{"version": 2, "captures": [], "new_field": 1}', "t.json: trace version 2 is newer"),
        (
            '{"captures": [{"phase": "decode", "bs": 1, "events": [["alloc", -1, 1, "temp"]]}]}',
            "t.json: $.captures[0].events[0][1]: Expected `int` >= 0",
        ),
        ('{"captures": [{"phase": "decode", "bs": 1, "events": [["alloc", 0, 1, "temp"]', "t.json: not valid JSON"),
    ],
)
def test_trace_values_once_silently_accepted_are_refused(cli, tmp_path, trace, needle):
    (tmp_path / "s.toml").write_text(SPEC)
    (tmp_path / "t.json").write_text(trace)
    one_line_error(cli("build", "-b", "fa3", "--spec", "s.toml", "--trace", "t.json"), needle)


@pytest.mark.parametrize("field,value", [("pool_bytes", -1), ("capture_seconds", -0.5), ("seconds", -1.0)])
def test_reports_with_negative_numbers_are_refused(cli, tmp_path, field, value):
    rep = report_json([StepMeasurement(step=0, id="capture/decode/1", reserved=1, predicted_reserved=1, seconds=0.1)])
    if field == "seconds":
        rep["steps"][0]["seconds"] = value
    else:
        rep[field] = value
    (tmp_path / "r.json").write_text(json.dumps(rep))
    one_line_error(
        cli("report", "r.json"), "r.json: $.", ">= 0", ", got -"
    )  # msgspec words it: "Expected `int` >= 0, got -1"


def test_absurd_plan_numbers_are_out_of_range(cli, tmp_path, plan_raw):
    (tmp_path / "p.json").write_bytes(
        reseal({**plan_raw, "predicted": {**plan_raw["predicted"], "pool_bytes": 10**300}})
    )
    one_line_error(cli("show", "p.json"), "p.json: $.predicted.pool_bytes: number out of range")


def test_the_wrong_kind_of_file_is_named(cli, tmp_path):
    trace_bytes = (ROOT / "plans/traces/fa3-ci.json").read_bytes()
    (tmp_path / "t.json").write_bytes(trace_bytes)
    one_line_error(cli("show", "t.json"), "t.json: this is a trace file, not a plan", "plans/*.json")
    (tmp_path / "p.json").write_bytes((ROOT / "plans/fa3-ci.json").read_bytes())
    one_line_error(cli("report", "p.json"), "p.json: this is a plan file, not a report")
    one_line_error(cli("build", "-b", "fa3", "--spec", "p.json"), "p.json: this is a plan file, not a spec")
    err = one_line_error(cli("build", "-b", "fa3", "--tp", "0"), "--tp: must be 1..")
    assert "--tp must" not in err
    (tmp_path / "s.toml").write_text(SPEC.replace("[1, 2]", '[1, "2"]'))
    one_line_error(
        cli("build", "-b", "fa3", "--spec", "s.toml"), "Expected `int`, got `str`", "fix: see `planner schema spec`"
    )


def test_checked_in_plans_decode_and_validate():
    paths = sorted((ROOT / "plans").glob("*.json"))
    # the plans docs and tests name: a glob that finds none (a moved folder) must not pass
    assert {p.name for p in paths} >= {"fa3.json", "fa3-ci.json", "fa3-eagle-ci.json", "fa3-ci-h200.json"}, paths
    for path in paths:
        assert decode_plan(path.read_bytes(), str(path)).name == path.stem


def _decoded_trace(data: bytes, name: str):
    """The trace ``data`` decodes to, and the most memory decoding it held (tracemalloc's peak)."""
    import tracemalloc

    from capture_plan.schemas.codec import decode_trace

    tracemalloc.start()
    try:
        trace = decode_trace(data, name)
        return trace, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_trace_decoding_memory_is_near_the_file_size():
    """Issue 18, fault 3: a trace cost ~23x its size (263 MiB: 5.9 GiB; a second full
    copy built by the standard json module for the duplicate-key check, a third by
    the conversion): 6.4x under tracemalloc here. Now about the typed events: 1.6x."""
    data = (ROOT / "plans/traces/fa3-ci.json").read_bytes()
    trace, peak = _decoded_trace(data, "fa3-ci.json")
    assert sum(len(c.events) for c in trace.captures) > 50_000
    assert peak < 2.5 * len(data), f"decoding took {peak / len(data):.1f}x the file's size"


def test_a_compact_trace_decodes_in_about_four_times_its_size():
    """Issue 29: the duplicate-key check's rewrite of the events (one regex match over a
    whole run) kept ~800 B of matcher state per event: 53x a compact trace's size here
    (a 263 MiB trace peaked at 7.8 GiB). Now the typed events themselves: ~4.2x (a struct
    and two ints an event), the rewrite 0.06x."""
    events = ",".join(f'["alloc",{i},{4096 + i},"temp"]' for i in range(100_000))
    data = ('{"version":1,"backend":"fa3","captures":[{"phase":"decode","bs":1,"events":[' + events + "]}]}").encode()
    trace, peak = _decoded_trace(data, "t.json")
    assert len(trace.captures[0].events) == 100_000
    assert peak < 4.5 * len(data), f"decoding took {peak / len(data):.1f}x the file's size"


@pytest.mark.parametrize(
    "damage",
    [
        b'"device": "\xff\xfe"',  # invalid UTF-8 inside a string the first pass skips
        b'"device": "\xc3"',  # a sequence cut short
        b'"device": "\xed\xa0\x80"',  # a UTF-16 surrogate written as UTF-8
    ],
)
def test_a_trace_with_invalid_utf8_is_a_located_error(cli, tmp_path, damage):
    trace = (ROOT / "plans/traces/fa3-ci.json").read_bytes()
    damaged = re.sub(rb'"device": "[^"]*"', lambda m: damage, trace, count=1)
    assert damaged != trace
    (tmp_path / "t.json").write_bytes(damaged)
    (tmp_path / "s.toml").write_text('[[phases]]\nname = "decode"\nkind = "decode"\nsizes = [1, 2]\n')
    code, out, err = cli("build", "-b", "fa3", "--spec", "s.toml", "--trace", "t.json", "--dry-run")
    assert code == 1 and err.startswith("planner: error: t.json: not valid JSON") and err.count("\n") == 1, err
    assert "fix: record the trace again with capture_plan.executor.profile" in err


def test_plan_files_that_are_corrupt_truncated_tampered_or_newer(cli, tmp_path):
    assert cli("build", "-b", "fa3")[0] == 0
    path = tmp_path / "plans/fa3.json"
    text = path.read_text()
    path.write_text(text[: len(text) // 2])
    code, _, err = cli("show", "plans/fa3.json")
    assert code == 1 and "plans/fa3.json: not valid JSON (truncated or corrupted?)" in err
    path.write_text(text.replace('"bs": 256', '"bs": 255', 1))
    code, _, err = cli("show", "plans/fa3.json")
    assert code == 1 and "plans/fa3.json: $.digest: digest mismatch" in err
    path.write_text(text.replace('"version": 1', '"version": 9', 1))
    code, _, err = cli("show", "plans/fa3.json")
    assert code == 1 and "plan version 9 is newer than this capture-plan understands (1)" in err
    code, _, err = cli("show", "plans/none.json")
    assert code == 1 and "plans/none.json: cannot read plan" in err


@pytest.mark.parametrize(
    "trace,message",
    [
        ('{"captures": [', "t.json: not valid JSON (truncated or corrupted?)"),
        (
            '{"captures": [{"phase": "decode", "bs": 1, "events": [["alloc", 0, -5, "temp"]]}]}',
            "t.json: $.captures[0].events[0][2]: Expected `int` >= 0",
        ),
        (
            '{"captures": [{"phase": "verify", "bs": 1, "events": []}]}',
            "t.json: $.captures[0].phase: unknown phase 'verify'",
        ),
        (
            '{"captures": [{"phase": "decode", "bs": 1, "events": []}]}',
            "t.json: phase 'decode': planned sizes [2] lie outside the recorded sizes 1..1",
        ),
        ('{"version": 7, "captures": []}', "t.json: trace version 7 is newer than this capture-plan understands (1)"),
    ],
)
def test_bad_traces_are_refused_with_one_line(cli, tmp_path, trace, message):
    (tmp_path / "s.toml").write_text('[[phases]]\nname = "decode"\nkind = "decode"\nsizes = [1, 2]\n')
    (tmp_path / "t.json").write_text(trace)
    code, out, err = cli("build", "-b", "fa3", "--spec", "s.toml", "--trace", "t.json")
    assert code == 1 and out == "" and err.startswith("planner: error: " + message), err
    assert not (tmp_path / "plans").exists()
