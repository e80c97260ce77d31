"""Fuzzing every input kind through the real ``planner`` entry point (issue 9).

Specs (TOML and JSON), plans, traces, reports, calibrations (also of other
models and backends) and traffic files (CSV, tab-separated, JSON, a Prometheus
scrape) are derived from valid seeds by truncation, byte flips, insertions,
type swaps, extreme numbers, huge lists, deep nesting, unicode, byte-order
marks, other encodings and duplicate keys, then fed to ``planner`` in-process.
Every input must end in exit 0 or in exit 1 with one ``planner: error:`` line
that names a fix (never ``fix: None``): never a usage error (2), an internal
error (3), a traceback, or a run past ``HANG_S`` seconds. An accepted input
must really be valid, judged by checks written independently of the
planner's (no duplicate keys, names matching the pattern exactly, numbers in
range, a plan's digest matching its content).

Examples per test: ``CAPTURE_PLAN_FUZZ_EXAMPLES`` (default 10, a few seconds
for the whole file); ``CAPTURE_PLAN_FUZZ_LOG=path`` appends one line per input
run (the command and its exit code), to count them over a long run::

    CAPTURE_PLAN_FUZZ_EXAMPLES=20000 CAPTURE_PLAN_FUZZ_LOG=/tmp/fuzz.log \\
        python -m pytest -q tests/test_cli_fuzz.py -p no:cacheprovider
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import re
import shutil
import signal
import sys
import tempfile
from pathlib import Path

import msgspec
import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st

from capture_plan.schemas.codec import canonical_bytes, plan_digest
from cli_inputs import LLAMA, reseal

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

EXAMPLES = int(os.environ.get("CAPTURE_PLAN_FUZZ_EXAMPLES", "10"))
LOG = os.environ.get("CAPTURE_PLAN_FUZZ_LOG")
#: a run past this many seconds fails its example (``CAPTURE_PLAN_FUZZ_HANG_S``: a long run on a
#: loaded machine reads the largest accepted plans, 50 MB of 160,000 alternatives, for ~15 s each)
HANG_S = int(os.environ.get("CAPTURE_PLAN_FUZZ_HANG_S", "60"))
#: list repetitions of the "huge list" mutation: CI keeps them small enough to stay fast
#: (a resealed plan with 20,000x its steps renders for seconds); long runs use the big ones
REPEATS = [2, 1000, 20000] if EXAMPLES > 100 else [2, 50, 5000]
FUZZ = settings(
    max_examples=EXAMPLES, deadline=None, derandomize=False, database=None, suppress_health_check=list(HealthCheck)
)

SPEC_TOML = """version = 1
name = "fz"
tp = 1
allocator = "native"
library_mib = 0
budget_mib = 100000
[model]
layers = 2
hidden = 256
heads = 4
kv_heads = 2
head_dim = 64
intermediate = 512
vocab = 1000
[[phases]]
name = "decode"
kind = "decode"
sizes = [1, 2, 4]
[[phases]]
name = "verify"
kind = "target_verify"
sizes = [1, 2]
tokens_per_request = 4
output_lifetime = "across-phases"
after = ["decode"]
[[rules]]
id = "team"
why = "w"
when = { backend = ["fa3"], ci = true }
require = [{ order = "smallest-first" }, { workspace = "hoisted" }]
"""
SPEC = tomllib.loads(SPEC_TOML)
TRACE_SPEC = (
    '[[phases]]\nname = "decode"\nkind = "decode"\nsizes = [1, 2]\n[model]\npreset = "llama-3-8b"\nlayers = 2\n'
)
TRACE = {
    "version": 1,
    "device": "fuzz",
    "backend": "fa3",
    "captures": [
        {
            "phase": "decode",
            "bs": bs,
            "events": [
                ["alloc", 0, 1024 * bs, "temp"],
                ["alloc", 1, 3 << 20, "output"],
                ["alloc", 2, 2048, "workspace"],
                ["free", 0, 0, "temp"],
            ],
        }
        for bs in (1, 2)
    ],
}
REPORT = {
    "plan": "fz",
    "plan_digest": "sha256:00",
    "device": "d",
    "torch": "2.11",
    "backend_module": "fa3",
    "pool_bytes": 3 << 20,
    "predicted_pool_bytes": 3 << 20,
    "capture_seconds": 0.5,
    "hoisted_bytes": 0,
    "steps": [
        {"step": 0, "id": "capture/decode/1", "reserved": 2 << 20, "predicted_reserved": 2 << 20, "seconds": 0.01}
    ],
}
NAME = re.compile(r"\A[a-z][a-z0-9_]*\Z")


# -- running the planner ---------------------------------------------------------------------


class Hang(Exception):
    pass


def _alarm(signum, frame):
    raise Hang(f"no answer within {HANG_S} s")


def planner(*args: str) -> tuple[int, str, str]:
    """``planner ARGS`` in-process: (exit code, stdout, stderr); a hang fails the example."""
    from capture_plan.planner.cli import main

    out, err = io.StringIO(), io.StringIO()
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(HANG_S)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(list(args))
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    if LOG:
        with open(LOG, "a") as f:
            f.write(f"{args[0]} {code}\n")
    return code, out.getvalue(), err.getvalue()


def expect_clean(result: tuple[int, str, str]) -> bool:
    """Exit 0, or exit 1 with exactly one located error line. True when accepted."""
    code, out, err = result
    assert code in (0, 1), f"exit {code}: {err[-2000:]}"
    assert "Traceback" not in err and "internal error" not in err, err[-2000:]
    if code == 1:
        assert err.startswith("planner: error: ") and err.count("\n") == 1, err[-2000:]
        # every deliberate error says how to fix it (issue 40): never without, never "None"
        assert "; fix: " in err and "fix: None" not in err, err[-2000:]
        return False
    return True


@pytest.fixture(scope="module")
def work():
    with tempfile.TemporaryDirectory() as d:
        yield Path(d)


@pytest.fixture(scope="module")
def seed_plan(work) -> bytes:
    (work / "seed.toml").write_text(SPEC_TOML)
    assert expect_clean(
        planner("build", "-b", "fa3", "--spec", str(work / "seed.toml"), "-o", str(work / "seed-plan.json"))
    )
    return (work / "seed-plan.json").read_bytes()


# -- mutations --------------------------------------------------------------------------------

EXTREME = [
    0,
    -1,
    1,
    2**31,
    2**53 + 1,
    2**63,
    2**64 + 5,
    10**200,
    -(10**30),
    1e308,
    -1e308,
    1.5,
    1e-300,
    float("inf"),
    float("nan"),
    True,
    None,
    "",
    "x" * 70,
    "decode\n",
    "\x00",
    "é\u202e",
    "\U0001f600",
    [],
    {},
    [1] * 5000,
    list(range(5000)),
    {"a": 1},
]


def _deep(n: int) -> str:
    return "[" * n + "]" * n


@st.composite
def values(draw):
    kind = draw(st.integers(0, 3))
    if kind == 0:
        return draw(st.sampled_from(EXTREME))
    if kind == 1:
        return draw(st.text(max_size=20))
    if kind == 2:
        return draw(st.integers(-(2**70), 2**70))
    return draw(
        st.recursive(
            st.none() | st.booleans() | st.integers(-5, 300) | st.text(max_size=5),
            lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=4), c, max_size=3),
            max_leaves=8,
        )
    )


def _paths(obj, path=()):
    yield path
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, path + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, path + (i,))


def _set(obj, path, value):
    if not path:
        return value
    obj = json.loads(json.dumps(obj))
    cur = obj
    for p in path[:-1]:
        cur = cur[p]
    cur[path[-1]] = value
    return obj


def _json(obj) -> str:
    """JSON with non-finite floats written as JSON readers refuse them (NaN, 1e999)."""
    return json.dumps(obj, ensure_ascii=False).replace("Infinity", "1e999")


@st.composite
def structured(draw, seed: dict) -> str:
    """The seed as JSON text after a structural mutation."""
    paths = list(_paths(seed))
    how = draw(st.sampled_from(["swap", "swap", "delete", "add", "duplicate", "deep", "repeat"]))
    path = draw(st.sampled_from(paths))
    if how == "swap":
        return _json(_set(seed, path, draw(values())))
    if how == "delete" and path:
        obj = json.loads(json.dumps(seed))
        cur = obj
        for p in path[:-1]:
            cur = cur[p]
        del cur[path[-1]]
        return _json(obj)
    if how == "add":
        dicts = [p for p in paths if isinstance(_get(seed, p), dict)]
        p = draw(st.sampled_from(dicts))
        return _json(_set(seed, p, {**_get(seed, p), draw(st.text(max_size=12)): draw(values())}))
    if how == "duplicate":  # a key written twice: the later one would silently win
        dicts = [p for p in paths if isinstance(_get(seed, p), dict) and _get(seed, p)]
        p = draw(st.sampled_from(dicts))
        key = draw(st.sampled_from(sorted(_get(seed, p))))
        marker = "__DUP__"
        text = _json(_set(seed, p, {marker: 0, **_get(seed, p)}))
        return text.replace(f'"{marker}": 0', f"{json.dumps(key)}: {_json(draw(values()))}", 1)
    if how == "deep":
        marker = "__DEEP__"
        return _json(_set(seed, path, marker)).replace(f'"{marker}"', _deep(draw(st.sampled_from([70, 1000, 50000]))))
    lists = [p for p in paths if isinstance(_get(seed, p), list)]
    p = draw(st.sampled_from(lists)) if lists else ()
    items = _get(seed, p) if lists else [seed]
    return _json(_set(seed, p, (items or [1]) * draw(st.sampled_from(REPEATS))))


def _get(obj, path):
    for p in path:
        obj = obj[p]
    return obj


@st.composite
def raw_bytes(draw, seed: bytes) -> bytes:
    """Byte-level damage: truncation, flips, insertions, BOMs, other encodings."""
    how = draw(st.sampled_from(["truncate", "flip", "insert", "delete", "bom", "encoding", "nul", "splice"]))
    n = len(seed)
    if how == "truncate":
        return seed[: draw(st.integers(0, n))]
    if how == "flip":
        data = bytearray(seed)
        for _ in range(draw(st.integers(1, 4))):
            data[draw(st.integers(0, n - 1))] = draw(st.integers(0, 255))
        return bytes(data)
    if how == "insert":
        i = draw(st.integers(0, n))
        return seed[:i] + draw(st.binary(min_size=1, max_size=16)) + seed[i:]
    if how == "delete":
        i = draw(st.integers(0, n - 1))
        return seed[:i] + seed[i + draw(st.integers(1, 16)) :]
    if how == "bom":
        return draw(st.sampled_from([b"\xef\xbb\xbf", b"\xff\xfe", b"\xfe\xff", b"\x00\x00\xfe\xff"])) + seed
    if how == "encoding":
        return (
            seed.decode()
            .encode(draw(st.sampled_from(["utf-16", "utf-16-le", "utf-32", "latin-1", "cp1252"])), errors="replace")
            .replace(b"fz", "fé".encode("latin-1"))
        )
    if how == "nul":
        i = draw(st.integers(0, n))
        return seed[:i] + b"\x00" + seed[i:]
    i, j = sorted((draw(st.integers(0, n)), draw(st.integers(0, n))))
    return seed[:i] + seed[j:] + seed[i:j]


TOML_LINES = [
    "version = 99",
    "version = -3",
    "library_mib = inf",
    "library_mib = nan",
    "budget_mib = 1e308",
    "tp = 0",
    "tp = 100000",
    "library_mib = 1" + "0" * 200,
    'name = "\\u0000"',
    'trace = "a\\u0000b"',
    'trace = "/dev/zero"',
    'trace = "."',
    "tp = 1",
    'allocator = "expandable"',
    "x = " + _deep(600),
    "x = " + "{a = " * 300 + "1" + "}" * 300,
    "layers = 1" + "0" * 5000,
    "vocab = 99999999999",
    "sizes = [" + ", ".join(map(str, range(1, 5000))) + "]",
    "sizes = [0]",
    "sizes = [1, 1]",
    'after = ["nope"]',
    'name = "decode\\n"',
    "[model]",
    "[[phases]]",
    "[[rules]]",
    "kind = 3",
    'output_lifetime = "forever"',
    "tokens_per_request = 999999",
    "heads = 3",
    "hidden = 1e3",
]


@st.composite
def toml_text(draw) -> bytes:
    how = draw(st.integers(0, 2))
    if how == 0:
        return draw(raw_bytes(SPEC_TOML.encode()))
    lines = SPEC_TOML.splitlines()
    for _ in range(draw(st.integers(1, 3))):
        i = draw(st.integers(0, len(lines)))
        new = (
            draw(st.sampled_from(TOML_LINES))
            if how == 1
            else f"{draw(st.sampled_from(['layers', 'sizes', 'name', 'tp', 'vocab', 'kind', 'id']))} = "
            f"{_toml_value(draw(values()))}"
        )
        if draw(st.booleans()) and i < len(lines) and "=" in lines[i] and "=" in new:
            lines[i] = lines[i].split("=")[0] + "= " + new.split("=", 1)[1].strip()
        else:
            lines.insert(i, new)
    return ("\n".join(lines) + "\n").encode("utf-8", "surrogatepass")


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return "nan" if math.isnan(v) else ("inf" if v == math.inf else "-inf" if v == -math.inf else repr(v))
    if isinstance(v, (int, str)):
        return json.dumps(v)
    if v is None:
        return '"null"'
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v[:50]) + "]"
    return "{" + ", ".join(f"{json.dumps(str(k))} = {_toml_value(x)}" for k, x in list(v.items())[:5]) + "}"


# -- independent validity checks for accepted inputs ----------------------------------------------


def _no_dup_json(data: bytes) -> None:
    def hook(pairs):
        keys = [k for k, _ in pairs]
        assert len(keys) == len(set(keys)), f"accepted duplicate keys {keys}"
        return dict(pairs)

    json.loads(data.decode("utf-8-sig"), object_pairs_hook=hook)


def _numbers_in_range(obj, non_negative=False) -> None:
    for p in _paths(obj):
        v = _get(obj, p)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        assert math.isfinite(v) and abs(v) <= 2**53, f"accepted {v!r} at {p}"
        if non_negative:
            assert v >= 0, f"accepted negative {v!r} at {p}"


def _spec_is_valid(raw: dict) -> None:
    assert raw.get("version", 1) == 1
    _numbers_in_range(raw)
    phases = raw["phases"]
    assert 1 <= len(phases) <= 32
    for ph in phases:
        assert NAME.match(ph["name"]), f"accepted phase name {ph['name']!r}"
        assert all(NAME.match(a) for a in ph.get("after", []))
        assert 1 <= len(ph["sizes"]) <= 4096 and len(set(ph["sizes"])) == len(ph["sizes"])
        assert all(isinstance(s, int) and 1 <= s <= 65536 for s in ph["sizes"])
    for r in raw.get("rules", []):
        assert re.fullmatch(r"[a-z0-9][a-z0-9_.-]*", r["id"]), f"accepted rule id {r['id']!r}"
    for k in ("library_mib", "budget_mib"):
        if raw.get(k) is not None:
            assert 0 <= raw[k] <= 2**30


def _check_written_plan(path: Path) -> None:
    raw = msgspec.json.decode(path.read_bytes())
    assert raw["digest"] == plan_digest(raw)
    assert len(raw["predicted"]["timeline"]) == len(raw["steps"])


# -- the tests --------------------------------------------------------------------------------------


@FUZZ
@given(data=toml_text())
def test_fuzz_spec_toml(work, data):
    spec, out = work / "s.toml", work / "s-out.json"
    spec.write_bytes(data)
    out.unlink(missing_ok=True)
    if expect_clean(planner("build", "-b", "fa3", "--ci", "--spec", str(spec), "-o", str(out), "--force")):
        _spec_is_valid(tomllib.loads(data.decode("utf-8-sig")))
        _check_written_plan(out)


@FUZZ
@given(data=st.one_of(structured(SPEC), raw_bytes(json.dumps(SPEC).encode()).map(lambda b: b.decode("latin-1"))))
def test_fuzz_spec_json(work, data):
    spec, out = work / "s.json", work / "j-out.json"
    spec.write_bytes(data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data)
    raw_data = spec.read_bytes()
    out.unlink(missing_ok=True)
    if expect_clean(planner("build", "-b", "fa3", "--spec", str(spec), "-o", str(out), "--force")):
        _no_dup_json(raw_data)
        _spec_is_valid(json.loads(raw_data.decode("utf-8-sig")))
        _check_written_plan(out)


@FUZZ
@given(data=st.data())
def test_fuzz_plan_bytes(work, seed_plan, data):
    """Damaged plan files: accepted only when the content is the same document."""
    mutated = data.draw(raw_bytes(seed_plan))
    path = work / "p.json"
    path.write_bytes(mutated)
    cmd = data.draw(
        st.sampled_from(
            [
                ("show",),
                ("explain",),
                ("simulate",),
                ("graph", "-f", "mermaid"),
                ("diff", str(work / "seed-plan.json")),
                ("report", "--plan"),
            ]
        )
    )
    args = (*cmd, str(path)) if cmd != ("report", "--plan") else ("report", str(work / "r.json"), "--plan", str(path))
    if cmd[0] == "report":
        (work / "r.json").write_text(json.dumps(REPORT))
    if expect_clean(planner(*args)):
        assert msgspec.json.decode(mutated.removeprefix(b"\xef\xbb\xbf")) == msgspec.json.decode(seed_plan), (
            "accepted a changed plan"
        )
        _no_dup_json(mutated)


@FUZZ
@given(data=st.data())
def test_fuzz_plan_resealed(work, seed_plan, data):
    """Structurally changed plans sealed again (a buggy or hostile writer): no crash
    anywhere, in the CLI or in ``capture_plan.executor.load_plan``."""
    from capture_plan.executor.load import load_plan
    from capture_plan.schemas.errors import InputError

    text = data.draw(structured(json.loads(seed_plan)))
    try:
        raw = msgspec.json.decode(text.encode("utf-8", "surrogatepass"))
        raw = {**raw, "digest": ""} if isinstance(raw, dict) else raw
        if isinstance(raw, dict):
            raw["digest"] = plan_digest(raw)
            text = canonical_bytes(raw).decode()
    except (msgspec.DecodeError, RecursionError, TypeError, ValueError, OverflowError):
        pass  # stays as it is: not valid JSON, or not sealable
    path = work / "q.json"
    path.write_bytes(text.encode("utf-8", "surrogatepass"))
    cmd = data.draw(st.sampled_from(["show", "explain", "simulate", "graph"]))
    accepted = expect_clean(planner(cmd, str(path)))
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(HANG_S)
    try:
        load_plan(path, check_env=False)
        loaded = True
    except InputError:
        loaded = False
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    if accepted or loaded:
        _plan_is_consistent(msgspec.json.decode(path.read_bytes()))


@FUZZ
@given(data=st.one_of(structured(TRACE), raw_bytes(json.dumps(TRACE).encode()).map(lambda b: b.decode("latin-1"))))
def test_fuzz_trace(work, data):
    (work / "ts.toml").write_text(TRACE_SPEC)
    trace = work / "t.json"
    trace.write_bytes(data.encode("utf-8", "surrogatepass"))
    raw_data = trace.read_bytes()
    if expect_clean(planner("build", "-b", "fa3", "--spec", str(work / "ts.toml"), "--trace", str(trace), "--dry-run")):
        _no_dup_json(raw_data)
        raw = json.loads(raw_data.decode("utf-8-sig"))
        assert raw.get("version", 1) == 1 and raw.get("backend", "") in ("", "fa3"), raw
        _numbers_in_range(raw, non_negative=True)


@FUZZ
@given(data=st.one_of(structured(REPORT), raw_bytes(json.dumps(REPORT).encode()).map(lambda b: b.decode("latin-1"))))
@example(data=json.dumps({**REPORT, "": -1}))  # found by CI: an unknown key is ignored, not a negative size
def test_fuzz_report(work, data):
    path = work / "r2.json"
    path.write_bytes(data.encode("utf-8", "surrogatepass"))
    raw_data = path.read_bytes()
    if expect_clean(planner("report", str(path))):
        _no_dup_json(raw_data)
        # reports are lenient (read across executor versions): keys the schema does not name are
        # ignored, so only the numbers it reads must be in range (an unknown "": -1 is no error)
        from capture_plan.schemas.report import CaptureReport

        read = msgspec.json.decode(raw_data.decode("utf-8-sig"), type=CaptureReport)
        _numbers_in_range(msgspec.to_builtins(read), non_negative=True)


ROOT = Path(__file__).resolve().parents[1]
#: the H200 report of plans/fa3-ci.json as the executor writes it now: naming the backend and the
#: model it measured (the checked-in bytes are bound through planner/data/calibrations.toml,
#: which no changed byte matches)
DIMS = json.loads((ROOT / "plans/fa3-ci.json").read_text())["inputs"]["model"]["dimensions"]
CALIBRATION = {
    **json.loads((ROOT / "plans/calibration/h200-fa3-ci.json").read_text()),
    "backend": "fa3",
    "model": {"dimensions": DIMS},
}
#: the kernel modules of fa3 (planner/data/backends.toml)
FA3_MODULES = {"flash_attn_interface": "fa3", "fa3_fwd_interface": "fa3"}
#: calibrations of other models and backends, and one that names neither: never taken by the
#: default build (issue 40, item 1)
OTHER_CALIBRATIONS = [
    {**CALIBRATION, "model": {"dimensions": {**DIMS, "layers": 80}}},
    {**CALIBRATION, "model": {"dimensions": {**DIMS, "hidden": 3584, "heads": 28, "kv_heads": 4}}},
    {**CALIBRATION, "model": {"dimensions": DIMS, "phases": {"decode": {"layers": 1}}}},
    {**CALIBRATION, "backend": "triton"},
    {k: v for k, v in CALIBRATION.items() if k not in ("model", "backend")},
]


def _record_text(rec: dict) -> list[str]:
    """The command a build record is the text of, written here apart from the planner's
    (capture_plan.schemas.plan.record_command): flags in the order `planner build` records them."""
    cmd = ["planner", "build", "--backend", rec["backend"]]
    cmd += ["--ci"] if rec.get("ci") else []
    for key in ("spec", "speculative", "preset", "max_bs", "tp", "allocator", "trace", "calibration"):
        if rec.get(key) is not None:
            cmd += ["--" + key.replace("_", "-"), str(rec[key])]
    cmd += ["--exact"] if rec.get("exact") else []
    for s in rec.get("strategies", []):
        cmd += ["--strategy", s]
    cmd += ["--sizes", rec["sizes"]] if rec.get("sizes") is not None else []
    cmd += ["--traffic", rec["traffic"]] if rec.get("traffic") is not None else []
    for p in rec.get("traffic_phases", []):
        cmd += ["--phase", p]
    keys = ("metric", "max_size", "timing", "device", "engine", "engine_flags", "context", "budget_mib", "max_graphs",
            "max_padding", "min_kv_tokens")  # fmt: skip
    for key in keys:
        value = rec.get(key)
        if key == "engine_flags":  # one --engine-flag per item
            for item in value or []:
                cmd += ["--engine-flag", item]
            continue
        if isinstance(value, float):  # a whole number of MiB or percent without its ".0"
            value = f"{value:.0f}" if value.is_integer() else repr(value)
        if value is not None:
            cmd += ["--" + key.replace("_", "-"), str(value)]
    return cmd + (["-o", rec["output"]] if rec.get("output") is not None else [])


def _plan_is_consistent(raw: dict) -> None:
    """What a plan that records its build must say alike in every place it says it."""
    rec = raw["inputs"].get("build")
    if rec is None:
        return
    assert raw["command"] == _record_text(rec), f"accepted command {raw['command']} for record {rec}"
    assert raw["inputs"]["backend"] == raw["requires"]["backend"] == rec["backend"], "accepted two backends"
    assert raw["inputs"]["ci"] == rec.get("ci", False) and raw["inputs"].get("speculative") == rec.get("speculative")


@FUZZ
@given(
    data=st.one_of(
        structured(CALIBRATION), raw_bytes(json.dumps(CALIBRATION).encode()).map(lambda b: b.decode("latin-1"))
    )
)
def test_fuzz_calibration(work, data):
    """A capture report given as --calibration: refused (one located line), or a plan that
    reads back with every device item a size (never negative, never unreadable)."""
    path, out = work / "cal.json", work / "cal-plan.json"
    path.write_bytes(data.encode("utf-8", "surrogatepass"))
    out.unlink(missing_ok=True)
    if expect_clean(planner("build", "-b", "fa3", "--ci", "--calibration", str(path), "-o", str(out), "--force")):
        _check_written_plan(out)
        assert expect_clean(planner("show", str(out))), "the plan it wrote does not read back"
        device = msgspec.json.decode(out.read_bytes())["predicted"]["device"]
        numbers = [i.get("bytes") for i in device["items"]] + [device.get("total_bytes"), device.get("peak_bytes")]
        assert all(n is None or 0 <= n <= 2**53 for n in numbers), device


@FUZZ
@given(
    data=st.sampled_from(OTHER_CALIBRATIONS).flatmap(
        lambda seed: st.one_of(
            st.just(json.dumps(seed)),
            structured(seed),
            raw_bytes(json.dumps(seed).encode()).map(lambda b: b.decode("latin-1")),
        )
    )
)
def test_fuzz_calibration_of_another_model(work, data):
    """A report of another model or backend (or of none named), however damaged: a build of
    the default model takes it only where what it says it measured is that model on fa3."""
    path, out = work / "other-cal.json", work / "other-cal-plan.json"
    path.write_bytes(data.encode("utf-8", "surrogatepass"))
    out.unlink(missing_ok=True)
    if expect_clean(planner("build", "-b", "fa3", "--ci", "--calibration", str(path), "-o", str(out), "--force")):
        raw = json.loads(path.read_bytes().decode("utf-8-sig"))
        # a report that does not name its backend is of the backend whose kernel module it loaded
        backend = raw.get("backend", FA3_MODULES.get(raw.get("backend_module")))  # type: ignore[arg-type]
        assert backend == "fa3", f"accepted a calibration of backend {raw.get('backend')!r}"
        model = raw.get("model")
        if model is None:  # only the bytes planner/data/calibrations.toml lists (those of fa3-ci's model)
            assert path.read_bytes() == (ROOT / "plans/calibration/h200-fa3-ci.json").read_bytes(), "accepted no model"
            return
        assert model["dimensions"] == DIMS, f"accepted a calibration of model {model}"
        assert not any(model.get("phases", {}).values()), f"accepted phase models {model['phases']}"
        _check_written_plan(out)


@FUZZ
@given(data=st.data())
def test_fuzz_resealed_pairs_for_diff_and_check(work, seed_plan, data):
    """Resealed plans through diff (against the seed) and check: accepted only when what
    they record is consistent, and `diff` says "no differences" only for the same document."""
    text = data.draw(structured(json.loads(seed_plan)))
    try:
        raw = msgspec.json.decode(text.encode("utf-8", "surrogatepass"))
    except (msgspec.DecodeError, RecursionError):
        return
    if not isinstance(raw, dict):
        return
    try:
        sealed = reseal(raw)
    except (TypeError, ValueError, OverflowError, msgspec.EncodeError):
        return
    folder = work / "pair"
    folder.mkdir(exist_ok=True)
    for old in folder.glob("*.json"):
        old.unlink()
    shutil.copy(work / "seed.toml", folder / "seed.toml")
    path = folder / "seed-plan.json"  # the seed's own name: a consistent plan checks up to date
    path.write_bytes(sealed)
    code, out, err = planner("diff", str(work / "seed-plan.json"), str(path))
    if expect_clean((code, out, err)):
        _plan_is_consistent(raw)
        if "no differences" in out:  # the same plan: a field left at its default may be written or left out
            from capture_plan.schemas.plan import Plan

            same = [msgspec.structs.replace(msgspec.json.decode(b, type=Plan), digest="") for b in (sealed, seed_plan)]
            a, b = (msgspec.to_builtins(p) for p in same)
            assert a == b, (
                f"diff: no differences, but {[k for k in a if a[k] != b.get(k)]} differ: {_first_difference(a, b)}"
            )
    if expect_clean(planner("check", str(folder))):
        _plan_is_consistent(raw)


def _first_difference(a, b, path="$"):
    """Where two decoded documents first differ, and how (a failure message)."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b), key=str):
            if a.get(k) != b.get(k):
                return _first_difference(a.get(k), b.get(k), f"{path}.{k}")
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return _first_difference(x, y, f"{path}[{i}]")
    return f"{path}: {a!r:.200} vs {b!r:.200}"


# -- traffic files (planner sizes --traffic; issue 40) ----------------------------------------------

TRAFFIC_SPEC = (
    "[model]\nlayers = 2\nhidden = 256\nheads = 4\nkv_heads = 2\nhead_dim = 64\nintermediate = 512\n"
    'vocab = 1000\n[[phases]]\nname = "decode"\nkind = "decode"\nsizes = [1, 2, 4, 8, 16, 32, 64]\n'
)
TRAFFIC_TOP = 64
_BUCKET = 'vllm:iteration_tokens_total_bucket{{engine="0",le="{le}"}} {n}'
TRAFFIC_SEEDS = [
    "size,count\n1,50\n3,20\n9,5\n17,3\n64,1\n",
    "1\n3\n1\n9\n64\n",  # a per-step log (issue 49, item 9)
    "count;size\n50;1\n20;3\n5;9\n",
    "size,phase\n1,decode\n9,decode\n",
    "size\tcount\n1\t50\n3\t20\n9\t5\n",
    "# steps per size\nPhase,Size,Count\ndecode,1,50\ndecode,9,5\n",
    json.dumps({"decode": {"1": 50, "9": 5, "64": 1}}),
    "# TYPE vllm:iteration_tokens_total histogram\n"
    + "\n".join(_BUCKET.format(le=le, n=n) for le, n in [("1.0", 5), ("4.0", 9), ("16.0", 12), ("64.0", 13)])
    + "\n"
    + _BUCKET.format(le="+Inf", n=13)
    + "\n",
]
TRAFFIC_LINES = [
    "1,\uff15", "\uff11,5", "Size,Count", "SIZE\tCOUNT", "1,-1", "1,1e3", "1,1.5", "0,1", "65,1", "64,1",
    "1,nan", "1,inf", "decode,1,1", "verify,1,1", "1\t2", "1\t2\t3", "1,2,3", "#", "", " ", "1, 2", "1,1_0",
    "2,0", '"1",2', "1;2", "\x00", "\r", "1,99999999999999999999", _BUCKET.format(le="2.0", n=1),
    _BUCKET.format(le="x", n=1), "# HELP x y", "count,size", "size", "count", "size;size", "7", "1;2;3;4",
    "5;decode", "decode;5", "phase;size", "1,1", "Count\tSize",
]  # fmt: skip
_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?|[+-]?(inf|infinity|nan)", re.ASCII | re.IGNORECASE)


@st.composite
def traffic_text(draw) -> bytes:
    seed = draw(st.sampled_from(TRAFFIC_SEEDS))
    if draw(st.booleans()):
        return draw(raw_bytes(seed.encode()))
    lines = seed.splitlines()
    for _ in range(draw(st.integers(1, 3))):
        lines.insert(draw(st.integers(0, len(lines))), draw(st.sampled_from(TRAFFIC_LINES)))
    return ("\n".join(lines) + "\n").encode()


def _whole(text: str) -> int:
    """A count as a reader written apart from the planner's takes it: ASCII, finite, whole, >= 0."""
    assert _NUMBER.fullmatch(text), f"accepted count {text!r}"
    x = float(text)
    assert math.isfinite(x) and x >= 0 and x == int(x) and x <= 2**53, f"accepted count {text!r}"
    return int(x)


def _traffic_is_valid(data: bytes) -> None:
    """What an accepted traffic file must be: CSV (commas, tabs or semicolons; a header naming size
    and any of phase and count; headerless size, size,count or phase,size,count), JSON or a scrape,
    every size 1..64 in ASCII digits, every count whole and >= 0, and some step at all."""
    import csv

    text = data.decode("utf-8-sig")
    lines = text.splitlines()
    if text.lstrip().startswith("{"):
        _no_dup_json(data)
        doc = json.loads(text)
        steps = 0
        for phase, sizes in doc.items():
            assert phase == "decode" and isinstance(sizes, dict), f"accepted phase {phase!r}: {sizes!r}"
            for size, n in sizes.items():
                assert re.fullmatch(r"[0-9]+", size, re.ASCII) and 1 <= int(size) <= TRAFFIC_TOP, size
                assert isinstance(n, (int, float)) and not isinstance(n, bool), n
                steps += _whole(repr(n))
        assert steps > 0, "accepted traffic of no steps"
        return
    if any(line.startswith(("# HELP ", "# TYPE ", "vllm:iteration_tokens_total")) for line in lines):
        series: dict[str, list[tuple[float, int]]] = {}
        for line in lines:
            if line.startswith("vllm:iteration_tokens_total_bucket"):
                labels, value = line.rsplit(" ", 1)
                le = re.search(r'le="([^"]*)"', labels)
                assert le is not None, f"accepted a bucket without le: {line!r}"
                series.setdefault(re.sub(r'le="[^"]*"', "", labels), []).append((float(le[1]), _whole(value)))
        assert series, "accepted a scrape without the histogram"
        for buckets in series.values():
            counts = [n for _, n in sorted(buckets)]
            assert counts == sorted(counts), f"accepted buckets that are not cumulative: {sorted(buckets)}"
        assert any(counts[-1] for counts in ([n for _, n in sorted(b)] for b in series.values())), "no steps"
        return
    first = next((line for line in lines if line.strip() and not line.lstrip().startswith("#")), "")
    # commas, else tabs, else semicolons (issue 49, item 9)
    delimiter = "," if "," in first else "\t" if "\t" in first else ";" if ";" in first else ","
    rows = [[c.strip() for c in row] for row in csv.reader(lines, delimiter=delimiter)]
    rows = [r for r in rows if r and any(r) and not r[0].startswith("#")]
    headerless = {1: ["size"], 2: ["size", "count"], 3: ["phase", "size", "count"]}
    names = [c.lower() for c in rows[0]] if rows else []
    if rows and not re.fullmatch(r"[0-9]+", rows[0][0], re.ASCII):
        # a header: size and any of phase and count, each once, in any order
        assert "size" in names and len(set(names)) == len(names) <= 3, f"accepted header {rows[0]!r}"
        assert set(names) <= {"phase", "size", "count"}, f"accepted header {rows[0]!r}"
        columns, rows = names, rows[1:]
    else:
        assert not rows or len(rows[0]) in headerless, f"accepted row {rows[0]!r}"
        columns = headerless[len(rows[0])] if rows else []
    steps = 0
    for row in rows:
        assert len(row) == len(columns), f"accepted row {row!r} under columns {columns}"
        cell = dict(zip(columns, row))
        assert cell.get("phase", "decode") == "decode", f"accepted phase {cell['phase']!r}"
        size = cell["size"]
        assert re.fullmatch(r"[0-9]+", size, re.ASCII) and 1 <= int(size) <= TRAFFIC_TOP, f"accepted size {size!r}"
        steps += _whole(cell["count"]) if "count" in cell else 1  # a size twice: its steps added
    assert steps > 0, "accepted traffic of no steps"


@FUZZ
@given(data=traffic_text())
def test_fuzz_traffic(work, data):
    """Traffic files (CSV, tab-separated, JSON, a Prometheus scrape), damaged: refused in one
    located line with a fix, or read only where a reader written apart from the planner's
    reads them as steps per size."""
    (work / "traffic-spec.toml").write_text(TRAFFIC_SPEC)
    path = work / "traffic.txt"
    path.write_bytes(data)
    args = ("sizes", "-b", "fa3", "--spec", str(work / "traffic-spec.toml"), "--traffic", str(path), "--upto", "4")
    if expect_clean(planner(*args)):
        _traffic_is_valid(data)


#: the numbers and words a user types into planner sizes' options (issue 49: --context had no bound)
SIZES_VALUES = st.one_of(
    st.sampled_from(
        ["0", "-1", "1", "2", "4", "63", "64", "65", "1024", "2048", "2049", "16777216", "16777217", "1000000000000",
         "1e3", "0.5", "1%", "nan", "inf", "-0", "", "decode", "verify", "NVIDIA H200", "NVIDIA H100 80GB HBM3",
         "NVIDIA Z9", "H100", "h200", "a100", "b200", "l40s", "h100 80gb", "H20", "vllm:iteration_tokens_total", "x"]
    ),
    # --engine, --engine-flag and --min-kv-tokens (issue 52 item 3)
    st.sampled_from(
        ["vllm==0.34.0", "vllm==0.33.0", "sglang==0.5.23", "vllm==0.35.9", "vllm", "max-model-len=2048",
         "max-model-len=0", "gpu-memory-utilization=0.9", "gpu-memory-utilization=nan", "context-length=2048",
         "enforce-eager=true", "kv-cache-dtype=fp8", "no-such=1", "max-model-len", "=", "400000", "9007199254740993"]
    ),
    st.text(max_size=8),
)  # fmt: skip
SIZES_FLAGS = ["--context", "--device", "--max-size", "--budget-mib", "--max-graphs", "--max-padding", "--phase",
               "--upto", "--metric", "--engine", "--engine-flag", "--min-kv-tokens"]  # fmt: skip
#: the devices with roofline figures (planner/data/devices.toml [roofline]): a size choice
#: without --timing prices step times on one of them
ROOFLINE = ("NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA A100-SXM4-80GB", "NVIDIA B200")
#: the devices with a memory total (planner/data/fit_devices.toml): an --engine prices KV tokens on one
MEMORY = ("NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA A100-SXM4-80GB", "NVIDIA A100-SXM4-40GB", "NVIDIA L40S",
          "NVIDIA GeForce RTX 4090", "NVIDIA RTX A5000")  # fmt: skip


def _named(given: str) -> str | None:
    """The device ``--device GIVEN`` names, by the rule docs/planner.md states: torch's name, or
    words (letters and digits) each a whole word of exactly one known name, case aside; None: no one."""
    known = sorted({*ROOFLINE, *MEMORY})
    words = re.findall(r"[a-z0-9]+", given.lower())
    found = (
        [given]
        if given in known
        else [k for k in known if words and set(words) <= set(re.findall(r"[a-z0-9]+", k.lower()))]
    )
    return found[0] if len(found) == 1 else None


#: the releases planner fit models (planner/data/fit_rules.toml): what an accepted --engine names
MODELLED = ("vllm==0.34.0", "vllm==0.33.0", "sglang==0.5.23")
#: the context window of the config.json spec below
WINDOW = 2048
#: the traffic of the sizes-options fuzz, each with its largest size (--max-size is at least that)
SIZES_TRAFFIC = {TRAFFIC_SEEDS[0]: 64, "1\n3\n1\n9\n64\n": 64, "count;size\n50;1\n20;3\n5;9\n": 9}


def _sizes_accepted_validly(flags: dict[str, str], config: bool, calibrated: bool, reach: int) -> None:
    """An accepted ``planner sizes`` had every option in range, judged apart from the planner: the
    last value of each flag (click keeps it)."""
    from capture_plan.schemas.limits import MAX_BS, MAX_CONTEXT

    def number(flag: str) -> float:
        v = flags[flag].strip().removesuffix("%") if flag == "--max-padding" else flags[flag]
        x = float(v)
        assert math.isfinite(x), f"accepted {flag} {flags[flag]!r}"
        return x

    if "--context" in flags:
        top = WINDOW if config else MAX_CONTEXT
        assert 1 <= int(flags["--context"]) <= top, f"accepted --context {flags['--context']!r} (bound {top})"
    if "--device" in flags:
        named = _named(flags["--device"])
        assert named in ROOFLINE, f"accepted --device {flags['--device']!r}"
        assert "--engine" not in flags or named in MEMORY, f"accepted --engine on --device {flags['--device']!r}"
        assert not calibrated or named == "NVIDIA H200", "accepted another device's roofline for an H200 calibration"
    if "--max-size" in flags:
        assert reach <= int(flags["--max-size"]) <= MAX_BS, f"accepted --max-size {flags['--max-size']!r}"
    for flag in ("--max-graphs", "--upto"):
        if flag in flags:
            assert int(flags[flag]) >= 1, f"accepted {flag} {flags[flag]!r}"
    if "--budget-mib" in flags:
        assert 0 < number("--budget-mib") < 2**30, f"accepted --budget-mib {flags['--budget-mib']!r}"
    if "--max-padding" in flags:
        assert 0 <= number("--max-padding") < 1e6, f"accepted --max-padding {flags['--max-padding']!r}"
    if "--phase" in flags:
        assert flags["--phase"] == "decode", f"accepted --phase {flags['--phase']!r}"
    if "--metric" in flags:
        assert flags["--metric"].strip(), f"accepted --metric {flags['--metric']!r}"
    if "--min-kv-tokens" in flags:
        assert 1 <= int(flags["--min-kv-tokens"]) <= 2**53, f"accepted --min-kv-tokens {flags['--min-kv-tokens']!r}"
        assert "--engine" in flags, "accepted --min-kv-tokens without --engine"
    if "--engine-flag" in flags:
        assert "--engine" in flags, "accepted --engine-flag without --engine"
    if "--engine" in flags:
        assert flags["--engine"] in MODELLED, f"accepted --engine {flags['--engine']!r}"
        assert "--device" in flags or calibrated, "accepted --engine without a device"


@FUZZ
@given(
    pairs=st.lists(st.tuples(st.sampled_from(SIZES_FLAGS), SIZES_VALUES), max_size=4),
    model=st.sampled_from(["dimensions", "config", "calibrated"]),
    traffic=st.sampled_from(sorted(SIZES_TRAFFIC)),
)
def test_fuzz_sizes_options(work, pairs, model, traffic):
    """What a user types into ``planner sizes`` (issue 49: --context, --device with a calibration,
    the new traffic forms): exit 0 only when every option is in range, 1 with one located line,
    or 2 (the framework's usage error: a word where a number goes)."""
    (work / "traffic-spec.toml").write_text(TRAFFIC_SPEC)
    (work / "config.json").write_text(json.dumps({**LLAMA, "max_position_embeddings": WINDOW}))
    (work / "config-spec.toml").write_text(
        '[model]\nconfig = "config.json"\n[[phases]]\nname = "decode"\nkind = "decode"\nsizes = [1, 2, 4, 64]\n'
    )
    (work / "sizes-traffic.csv").write_text(traffic)
    args = ["sizes", "-b", "fa3", "--traffic", str(work / "sizes-traffic.csv")]
    if model == "calibrated":  # the embedded spec's model, the H200 calibration measured of it
        args += ["--ci", "--calibration", str(ROOT / "plans/calibration/h200-fa3-ci.json")]
    else:
        args += ["--spec", str(work / ("config-spec.toml" if model == "config" else "traffic-spec.toml"))]
    flags: dict[str, str] = {}
    for flag, value in pairs:
        value = value.replace("\x00", "")
        args += [flag, value]
        flags[flag] = value
    if "--upto" not in flags:
        args += ["--upto", "4"]
    code, out, err = planner(*args)
    if code == 2:
        assert "Usage: planner sizes" in err and "Traceback" not in err, err
    elif expect_clean((code, out, err)):
        _sizes_accepted_validly(flags, model == "config", model == "calibrated", SIZES_TRAFFIC[traffic])


@pytest.fixture(scope="module")
def check_dir(work) -> Path:
    """A folder holding one up-to-date plan (fz.json) and the spec it records."""
    folder = work / "check"
    folder.mkdir()
    (folder / "seed.toml").write_text(SPEC_TOML)
    code, _, err = planner("build", "-b", "fa3", "--spec", str(folder / "seed.toml"), "-o", str(folder / "fz.json"))
    assert code == 0, err
    return folder


@FUZZ
@given(files=st.lists(st.tuples(st.sampled_from(["a", "b", "config", "t"]), st.sampled_from(["plan", "config",
       "trace", "array", "cut", "text"])), max_size=4))  # fmt: skip
def test_fuzz_check_folder(check_dir, files):
    """``planner check DIR`` over a plan beside other files (issue 49, item 8): a JSON that is not
    a plan is skipped (exit 0 where nothing else is wrong), a file that is not JSON is an error, and
    a copy of the plan under another name is stale."""
    for old in check_dir.glob("*.json"):
        if old.name != "fz.json":
            old.unlink()
    plan = (check_dir / "fz.json").read_bytes()
    bodies = {
        "plan": plan,
        "config": json.dumps(LLAMA).encode(),
        "trace": json.dumps(TRACE).encode(),
        "array": b"[1, 2]",
        "cut": plan[: len(plan) // 2],
        "text": b"size,count\n1,2\n",
    }
    for name, kind in files:
        (check_dir / f"{name}.json").write_bytes(bodies[kind])
    written = {f"{n}.json": k for n, k in files}  # the last write of each name
    code, out, err = planner("check", str(check_dir))
    assert code in (0, 1) and "Traceback" not in err, (code, err[-2000:])
    # several stale plans: one line each, then the summary (docs/ci.md)
    assert code == 0 or (err and all(line.startswith("planner: error: ") for line in err.splitlines())), err
    assert (code == 0) == (not {"cut", "text", "plan"} & set(written.values())), (written, err)
    assert all(f"{n}: skipped, not a plan file" in out for n, k in written.items() if k != "plan" and code == 0)


SPECIAL = ["dir", "fifo", "/dev/zero", "/dev/urandom", "/dev/null", "missing", "loop", "dangling", "empty", "nul"]


@pytest.mark.parametrize("where", SPECIAL)
@pytest.mark.parametrize("kind", ["spec-toml", "spec-json", "plan", "trace", "report", "output"])
def test_special_files_where_a_file_is_expected(tmp_path, where, kind):
    """Directories, FIFOs, devices, missing files, links that go nowhere: exit 1, one line, no hang."""
    name = {"spec-toml": "x.toml"}.get(kind, "x.json")
    target = tmp_path / name
    if where == "dir":
        target.mkdir()
    elif where == "fifo":
        os.mkfifo(target)
    elif where.startswith("/dev/"):
        target = Path(where)
    elif where == "loop":
        os.symlink(target, target)
    elif where == "dangling":
        os.symlink(tmp_path / "nowhere" / "x", target)
    elif where == "empty":
        target.write_bytes(b"")
    elif where == "nul":  # argv cannot carry a NUL byte; a file can (a spec's trace path): the library
        from capture_plan.schemas.errors import InputError
        from capture_plan.schemas.files import read_input, write_atomic

        with pytest.raises(InputError, match="NUL"):
            (write_atomic if kind == "output" else read_input)(
                Path(str(target) + "\x00x"), *((b"x",) if kind == "output" else (kind.split("-")[0],))
            )
        return
    (tmp_path / "s.toml").write_text(TRACE_SPEC)
    args = {
        "spec-toml": ("build", "-b", "fa3", "--spec", str(target), "--dry-run"),
        "spec-json": ("build", "-b", "fa3", "--spec", str(target), "--dry-run"),
        "plan": ("show", str(target)),
        "trace": ("build", "-b", "fa3", "--spec", str(tmp_path / "s.toml"), "--trace", str(target), "--dry-run"),
        "report": ("report", str(target)),
        "output": ("build", "-b", "fa3", "-o", str(target)),
    }[kind]
    accepted = expect_clean(planner(*args))
    # only an output may be new (a missing file, the target of a dangling link); nothing else is accepted
    assert not accepted or (kind == "output" and where in ("missing", "dangling")), f"{kind} {where} accepted"
    if kind == "output" and where.startswith("/dev/"):  # --force never replaces a device
        expect_clean(planner(*args, "--force"))
        assert not Path(where).is_file()


OPTION_VALUES = st.one_of(
    st.sampled_from(
        [
            "",
            "fa3",
            "eagle",
            "native",
            "expandable",
            "0",
            "-1",
            "8",
            "2",
            "order=smallest-first",
            "decode.outputs=keep",
            "=",
            "x.y=z",
            "1e9",
            "99999999999999999999",
            "plans",
            ".",
        ]
    ),
    st.text(max_size=12),
)


@FUZZ
@given(
    pairs=st.lists(
        st.tuples(
            st.sampled_from(
                [
                    "--backend",
                    "--speculative",
                    "--max-bs",
                    "--tp",
                    "--allocator",
                    "-s",
                    "--ci",
                    "--exact",
                    "-o",
                    "--device",
                    "--engine",
                    "--engine-flag",
                ]
            ),
            st.one_of(
                OPTION_VALUES,
                st.sampled_from(
                    [
                        "NVIDIA H100 80GB HBM3",
                        "vllm==0.34.0",
                        "sglang==0.5.23",
                        "vllm==0.1",
                        "max-model-len=4096",
                        "context-length=4096",
                        "block-size=0",
                        "max-num-seqs=x",
                        "kv-cache-dtype=fp8",
                    ]
                ),
            ),
        ),
        max_size=5,
    )
)
def test_fuzz_build_options(work, pairs):
    """What a user types: exit 0, 1 (bad value) or 2 (the framework's usage error), nothing else."""
    args = ["build", "--max-bs", "16", "--dry-run"]
    for flag, value in pairs:
        args += [flag] if flag in ("--ci", "--exact") else [flag, value.replace("\x00", "")]
    if "--backend" not in args:
        args += ["--backend", "fa3"]
    code, out, err = planner(*args)
    if code == 2:
        assert "Usage: planner build" in err and "Traceback" not in err, err
    else:
        expect_clean((code, out, err))


@pytest.fixture(scope="module")
def kv_pair(work) -> tuple[Path, Path, Path]:
    """Two plans that record KV tokens (``--engine``: 9 and 36 sizes) and one that does not."""
    engine = ("--device", "NVIDIA H100 80GB HBM3", "--engine", "vllm==0.34.0", "--engine-flag", "max-model-len=8192")
    traffic = ROOT / "tests" / "data" / "traffic-skewed.csv"
    paths = (work / "kv9.json", work / "kv36.json", work / "plain.json")
    auto = ("--sizes", "auto", "--traffic", str(traffic), "--max-graphs", "9")
    for args in ((*engine, *auto, "-o", str(paths[0])), (*engine, "-o", str(paths[1])), ("-o", str(paths[2]))):
        code, _, err = planner("build", "-b", "fa3", *args)
        assert code == 0, err
    return paths


@FUZZ
@given(
    value=st.one_of(
        st.integers(-(1 << 70), 1 << 70).map(str),
        st.sampled_from(["", "0", "1,000", "1_000", "5%", "64MiB", "nan", "1e3", "-0", "٣", "²"]),
        st.text(max_size=10),
    ),
    pair=st.sampled_from([(0, 1), (1, 0), (0, 2), (2, 1)]),
    fmt=st.sampled_from(["text", "markdown"]),
)
def test_fuzz_diff_kv_gate(kv_pair, value, pair, fmt):
    """``diff --fail-above-kv-tokens`` (issue 52 item 3): any value ends in exit 0 or one located
    line; it passes only a whole count at least the tokens the new plan costs."""
    old, new = (kv_pair[i] for i in pair)
    code, out, err = planner("diff", str(old), str(new), "--fail-above-kv-tokens", value.replace("\x00", ""), "-f", fmt)
    if code == 2:
        assert "Usage: planner diff" in err and "Traceback" not in err, err
    elif expect_clean((code, out, err)):
        tokens = int(value.strip().replace(",", "").replace("_", ""))
        kv = [json.loads(p.read_text())["predicted"]["kv"]["kv_tokens"] for p in (old, new)]
        assert 2 not in pair and kv[0] - kv[1] <= tokens, (value, kv)


# -- what the fuzz runs found (issue 29), one regression test per class ----------------------------


def _calibration(tmp_path: Path, change) -> tuple[int, str, str, Path]:
    report = json.loads(json.dumps(CALIBRATION))
    change(report)
    (tmp_path / "cal.json").write_text(json.dumps(report))
    out = tmp_path / "p.json"
    result = planner("build", "-b", "fa3", "--ci", "--calibration", str(tmp_path / "cal.json"), "-o", str(out))
    return (*result, out)


def _capture_index(report: dict, nth: int = 1) -> int:
    return [i for i, s in enumerate(report["steps"]) if s["id"].startswith("capture/")][nth]


def test_a_calibration_step_id_without_a_numeric_size_is_refused_where_it_is(tmp_path):
    """Was an internal error: ValueError: invalid literal for int() in planner/memory/device.py."""
    i = _capture_index(CALIBRATION)

    def rename(r):
        r["steps"][i]["id"] = "capture/decode/x"

    code, out, err, plan = _calibration(tmp_path, rename)
    assert code == 1 and err.count("\n") == 1, err
    assert f"cal.json: $.steps[{i}].id: 'capture/decode/x' is not a step id (<op>/<phase>/<bs>" in err
    assert not plan.exists()


def test_free_memory_growing_over_a_capture_is_refused_not_a_negative_plan(tmp_path):
    """Was a plan with "reserve for capture: -33,944.3 MiB" that then failed to read back."""
    i = _capture_index(CALIBRATION, 3)

    def grow(r):
        r["steps"][i]["free"] = r["steps"][i - 1]["free"] + (1 << 30)

    code, out, err, plan = _calibration(tmp_path, grow)
    assert code == 1 and err.count("\n") == 1, err
    assert f"cal.json: $.steps[{i}].free: capture step " in err and "something else ran on the device" in err
    assert "fix: capture the plan again on an otherwise idle device" in err
    assert not plan.exists()


def test_a_calibration_that_adds_up_past_any_device_is_refused(tmp_path):
    """Each number in range, their sum past 2**53: the plan would not read back."""
    second = _capture_index(CALIBRATION, 1)

    def huge(r):
        for i, s in enumerate(r["steps"]):
            s.pop("graph_nodes", None)  # graph memory per graph, not per node
            # all of 2**53 B taken over one capture, none over the others
            s["free"], s["allocator_reserved"] = (2**53 if i < second else 0), 0

    code, out, err, plan = _calibration(tmp_path, huge)
    assert code == 1 and "more than any device holds" in err, err
    assert not plan.exists()


@pytest.mark.parametrize(
    "edit, field, says",
    [
        (lambda p: p.update(command=p["command"][:3] + ["triton"]), "$.command", "`command` is `planner build"),
        (
            lambda p: p["inputs"]["build"].update(backend="triton"),
            "$.command",
            "records `planner build --backend triton",
        ),
        (lambda p: p["inputs"].update(backend="triton"), "$.inputs.backend", "says 'triton' but the build it records"),
        (lambda p: p["requires"].update(backend="triton"), "$.requires.backend", "says 'triton'"),
        (lambda p: p["inputs"].update(ci=False), "$.inputs.ci", "says False but the build it records"),
        (lambda p: p["inputs"].update(speculative="eagle"), "$.inputs.speculative", "says 'eagle'"),
        (lambda p: p["inputs"].update(strategies=["order=smallest-first"]), "$.inputs.strategies", "says"),
    ],
)
def test_a_resealed_plan_whose_record_and_command_disagree_is_refused_naming_both(tmp_path, edit, field, says):
    """Was accepted by load_plan, show and diff (diff: "no differences" for plans whose
    bytes differ), and `check --fix` rebuilt it from the record for the other backend."""
    from capture_plan.executor.load import load_plan
    from capture_plan.schemas.errors import InputError

    raw = json.loads((ROOT / "plans/fa3-ci.json").read_text())
    edit(raw)
    (tmp_path / "plans").mkdir()
    path = tmp_path / "plans/fa3-ci.json"
    path.write_bytes(reseal(raw))
    before = path.read_bytes()
    for args in (
        ("show", str(path)),
        ("diff", str(ROOT / "plans/fa3-ci.json"), str(path)),
        ("check", str(tmp_path / "plans")),
        ("check", "--fix", str(tmp_path / "plans")),
    ):
        code, out, err = planner(*args)
        assert code == 1 and err.count("\n") == 1 and f"fa3-ci.json: {field}: " in err and says in err, (args, err)
    assert path.read_bytes() == before  # --fix rebuilt nothing
    with pytest.raises(InputError, match=re.escape(field)):
        load_plan(path, check_env=False)


def test_diff_of_plans_that_differ_only_in_a_decisions_alternatives_says_they_differ(tmp_path):
    """Was "no differences in inputs, steps, decisions or predictions" (and exit 0 with
    --exit-code) for a resealed plan whose rejected alternatives were edited."""
    raw = json.loads((ROOT / "plans/fa3-ci.json").read_text())
    decision = next(d for d in raw["decisions"] if d["alternatives"])
    decision["alternatives"][0]["pool_bytes"] += 1
    path = tmp_path / "fa3-ci.json"
    path.write_bytes(reseal(raw))
    code, out, err = planner("diff", str(ROOT / "plans/fa3-ci.json"), str(path), "--exit-code")
    assert code == 1 and "no differences" not in out, out
    assert out.splitlines()[-1] == (
        "other recorded detail differs (a decision's alternatives or reasons): `planner explain` each plan"
    )
    code, out, err = planner("diff", str(ROOT / "plans/fa3-ci.json"), str(ROOT / "plans/fa3-ci.json"), "--exit-code")
    assert code == 0 and "no differences" in out


#: `planner fit`'s seeds: a real config.json (Qwen3-30B-A3B, MoE) and an MLA one
FIT_CONFIGS = [
    json.loads((Path(__file__).parent.parent / "planner/data/configs" / n).read_text())
    for n in ("qwen3-30b-a3b.json", "deepseek-v2-lite.json", "gemma-2-9b.json")
]


@FUZZ
@given(
    data=st.one_of(
        *(structured(c) for c in FIT_CONFIGS),
        raw_bytes(json.dumps(FIT_CONFIGS[0]).encode()).map(lambda b: b.decode("latin-1")),
    ),
    engine=st.sampled_from(["vllm==0.34.0", "vllm==0.33.0", "sglang==0.5.23"]),
)
def test_fuzz_fit_config(work, data, engine):
    """fit's model input: every mutated config.json ends in a table or one located error."""
    cfg = work / "fit-config.json"
    cfg.write_bytes(data.encode("utf-8", "surrogatepass"))
    expect_clean(planner("fit", "--model", str(cfg), "--device", "H100", "--engine", engine))


def _fit_options() -> dict[str, str]:
    """Every option of ``planner fit`` (planner/cli/fit.py: the engine flags of
    planner/data/fit_flags.toml and fit's own), with how the fuzz gives it a value: "value" (a
    number, word or list), "switch" (a flag alone), "path" (a file), "fixed" (always given)."""
    from capture_plan.planner.cli.fit import command

    kinds = {"--model": "fixed", "--device": "fixed", "--engine": "fixed"}
    for p in command.params:
        name = max(p.opts, key=len)
        if name in kinds:
            continue
        if getattr(p, "is_flag", False):
            kinds[name] = "switch"
        elif name in ("--weights-index", "--plan", "--calibration", "--speculative-draft-model-path"):
            kinds[name] = "path"
        else:
            kinds[name] = "value"
    return kinds


FIT_OPTIONS = _fit_options()
#: the models the flags fuzz runs: a preset (no context length) and configs with one (vLLM and
#: SGLang both derive it from max_position_embeddings here: llama3 and yarn rows are not scaled)
FIT_MODELS = {
    "llama-3-8b": None,
    str(ROOT / "planner/data/configs/llama-3.1-8b.json"): 131072,
    str(ROOT / "planner/data/configs/qwen2.5-7b.json"): 32768,
    str(ROOT / "planner/data/configs/deepseek-v2-lite.json"): 163840,
}
#: the files --weights-index, --plan and --calibration are given (real, missing, not JSON)
FIT_PATHS = [
    str(ROOT / "planner/data/configs/eagle-llama-3.1-8b.json"),
    str(ROOT / "plans/fa3-ci-h200.json"),
    str(ROOT / "plans/calibration/h200-fa3-ci.json"),
    str(ROOT / "tests/data/traffic-skewed.csv"),
    "missing.json",
]
#: values of the speculative-decoding flags (vLLM's --speculative-config JSON, SGLang's algorithm)
SPEC_VALUES = [
    '{"method": "eagle", "model": "%s", "num_speculative_tokens": 3}'
    % (ROOT / "planner/data/configs/eagle-llama-3.1-8b.json"),
    '{"method": "eagle3", "model": "llama-3-8b", "num_speculative_tokens": 2}',
    '{"method": "draft_model", "model": "llama-3-8b", "num_speculative_tokens": 4}',
    '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5}',
    '{"method": "mtp", "num_speculative_tokens": 1}',
    '{"method": "eagle", "model": null, "num_speculative_tokens": true}',
    '{"model": "ngram"}',
    "{",
    "[]",
    '{"method": "eagle", "model": {"a": 1}, "num_speculative_tokens": 1e300}',
    "EAGLE",
    "EAGLE3",
    "NEXTN",
    "NGRAM",
    "STANDALONE",
]
#: the variables that let a longer context through, as each engine reads them
ALLOW = {"vllm": "VLLM_ALLOW_LONG_MAX_MODEL_LEN", "sglang": "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN"}


def _allowed(engine: str, env: tuple[str, str] | None) -> bool:
    """Whether ``env`` lets ``engine`` take a longer context, judged apart from fit: vLLM's
    envs.py (stripped, lower-cased, 1 or true), SGLang's EnvBool (lower-cased: true, 1, yes, y)."""
    if env is None or env[0] != ALLOW[engine]:
        return False
    value = env[1].strip().lower() if engine == "vllm" else env[1].lower()
    return value in (("1", "true") if engine == "vllm" else ("true", "1", "yes", "y"))


def test_the_fit_fuzz_gives_every_option_of_planner_fit():
    """A new option of ``planner fit`` joins the fuzz without an edit; each engine flag is one."""
    from capture_plan.planner.fit.flags import engine_flags

    assert {f"--{n}" for n in engine_flags()} <= set(FIT_OPTIONS)
    assert {"--tp", "--weights-index", "--plan", "--calibration", "--json", "--enforce-eager"} <= set(FIT_OPTIONS)


@FUZZ
@given(
    engine=st.sampled_from(["vllm==0.34.0", "vllm==0.29.0", "sglang==0.5.23", "vllm==0.2", "sglang==x", "tgi==1.0"]),
    device=st.sampled_from(["H100", "H200", "NVIDIA A100-SXM4-40GB", "RTX 4090", "A100", "", "B300"]),
    model=st.sampled_from(sorted(FIT_MODELS)),
    env=st.one_of(
        st.none(),
        st.tuples(st.sampled_from(sorted(ALLOW.values())), st.sampled_from(["1", "true", " TRUE ", "yes", "0", ""])),
    ),
    flags=st.lists(
        st.tuples(
            st.sampled_from(sorted(n for n, k in FIT_OPTIONS.items() if k != "fixed")),
            st.one_of(
                st.integers(-5, 1 << 40).map(str),
                st.floats(allow_nan=True, allow_infinity=True).map(str),
                st.sampled_from(["auto", "fp8", "NONE", "PIECEWISE", "1,2,x", "0", "", "1,2,4"]),
                st.sampled_from(["2048", "8192", "32768", "32769", "131072", "131073", "163840", "163841"]),
                st.sampled_from(SPEC_VALUES),
            ),
            st.sampled_from(FIT_PATHS),
        ),
        max_size=4,
    ),
)
def test_fuzz_fit_flags(work, engine, device, model, env, flags):
    """fit's options (every one of them: FIT_OPTIONS), models with and without a context length,
    and the engines' variables that allow a longer one: exit 0 or one located error line. An
    accepted context length is at most the model's unless the engine's variable allows it, judged
    apart from fit; a refused one names the model's as its fix."""
    args = ["fit", "--model", model, "--device", device, "--engine", engine]
    given: dict[str, str] = {}
    for name, value, path in flags:
        kind = FIT_OPTIONS[name]
        args += [name] if kind == "switch" else [name, path if kind == "path" else value]
        given[name] = path if kind == "path" else value
    saved = {name: os.environ.pop(name, None) for name in ALLOW.values()}
    try:
        if env is not None:
            os.environ[env[0]] = env[1]
        code, out, err = planner(*args)
    finally:
        for name, value in saved.items():
            os.environ.pop(name, None)
            if value is not None:
                os.environ[name] = value
    if code == 2:  # click's usage error for a value of the wrong type: its own message
        assert "Usage:" in err, err
        return
    accepted = expect_clean((code, out, err))
    limit, name = FIT_MODELS[model], engine.split("==")[0]
    flag = "--context-length" if name == "sglang" else "--max-model-len"
    if accepted and limit is not None and flag in given:
        value = int(given[flag])
        assert value <= limit or _allowed(name, env), f"accepted {flag} {value} past {limit} ({env})"
    if not accepted and "tokens are more than the" in err:
        assert f"{flag} {limit}`" in err and not _allowed(name, env), err


@pytest.mark.parametrize(
    ("edit", "field", "says"),
    [
        (lambda d: d.clear(), "$.predicted.device.items", "a device prediction with no items"),
        (lambda d: d.update(total_bytes=1), "$.predicted.device.total_bytes", "not the sum of its items"),
    ],
)
def test_a_resealed_plan_whose_device_prediction_disagrees_with_itself_is_refused(tmp_path, edit, field, says):
    """Found by the fuzz at seed 49 (7,000 examples a test): a resealed plan whose device
    prediction was `{}` ended `planner show` in an internal error (IndexError in render)."""
    from capture_plan.executor.load import load_plan
    from capture_plan.schemas.errors import InputError

    raw = json.loads((ROOT / "plans/fa3-ci.json").read_text())
    edit(raw["predicted"]["device"])
    path = tmp_path / "fa3-ci.json"
    path.write_bytes(reseal(raw))
    for cmd in ("show", "explain", "simulate", "graph"):
        code, out, err = planner(cmd, str(path))
        assert code == 1 and err.count("\n") == 1 and f"{field}: " in err and says in err, (cmd, err)
    with pytest.raises(InputError, match=re.escape(field)):
        load_plan(path, check_env=False)
