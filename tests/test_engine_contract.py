"""The engines' hook points (capture_plan.adapters.plugins.hooks.HOOKS) against the
released engines' wheels, read with zipfile + ast: nothing installed, nothing of the
engines imported.

``.ci/run`` downloads the wheels (``.ci/engine_wheels.py``: one ``pip download --no-deps``
per pin that ``python -m capture_plan.adapters.plugins.hooks`` prints) into
``.cache/engine-wheels`` (or ``$CAPTURE_PLAN_ENGINE_WHEELS``) before the full suite, which
runs with ``CAPTURE_PLAN_ONLY_GPU_SKIPS=1``: a wheel test that skips there fails CI.
Elsewhere, where the wheels are not there, the wheel tests skip naming the command that
gets them. The checker's own tests (a name gone, a signature changed, a constant changed)
need no wheel.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from capture_plan.adapters.plugins import contract
from capture_plan.adapters.plugins.hook_point import HookPoint
from capture_plan.adapters.plugins.hooks import HOOKS, KNOWN, hook, requirements

ROOT = Path(__file__).resolve().parent.parent
WHEELS = Path(os.environ.get("CAPTURE_PLAN_ENGINE_WHEELS") or ROOT / ".cache" / "engine-wheels")
RELEASES = [(e, v) for e, versions in KNOWN.items() for v in versions]


def wheel_source(engine: str, version: str, file: str) -> str:
    """``file``'s text in the release's wheel under :data:`WHEELS` (read with zipfile: nothing
    installed); the test skips where the wheel is missing (.ci/run downloads it, and CI fails a
    skip there)."""
    import zipfile

    wheel = contract.find_wheel(WHEELS, engine, version)
    if wheel is None:
        pytest.skip(f"no {engine}-{version} wheel in {WHEELS} (.ci/run downloads it)")
    with zipfile.ZipFile(wheel) as z:
        return z.read(file).decode()


@pytest.mark.parametrize(("engine", "version"), RELEASES, ids=[f"{e}-{v}" for e, v in RELEASES])
def test_every_hook_point_exists_in_the_release_it_names(engine, version):
    wheel = contract.find_wheel(WHEELS, engine, version)
    if wheel is None:
        pytest.skip(
            f"no {engine}-{version} wheel in {WHEELS} (.ci/run downloads it: "
            f"pip download --no-deps -d {WHEELS} {engine}=={version})"
        )
    rows = [h for h in HOOKS if (h.engine, h.version) == (engine, version)]
    assert contract.check_wheel(wheel, rows) == []


def test_the_table_is_one_row_per_name_and_knows_both_engines():
    keys = [(h.engine, h.version, h.name) for h in HOOKS]
    assert len(keys) == len(set(keys))
    assert set(KNOWN) == {"sglang", "vllm"}
    files = sorted((ROOT / "planner/data/releases").glob("*.toml"))
    assert requirements() == [f.stem.replace("-", "==", 1) for f in files]  # one file a release, no list
    assert {"sglang==0.5.23", "vllm==0.33.0", "vllm==0.34.0"} <= set(requirements())
    for h in HOOKS:
        assert h.file.startswith(f"{h.engine}/") and h.file.endswith(".py")
        assert h.signature in ("class", "attribute") or h.signature.startswith(("(", "= ", ": ")), h
    assert hook("vllm", "0.33.0", "profile_cudagraph_memory").module == "vllm.v1.worker.gpu.cudagraph_utils"
    assert hook("sglang", "0.5.23", "GENERAL_PLUGINS_GROUP").module == "sglang.srt.plugins"
    with pytest.raises(KeyError, match="no hook point 'capture_graph'"):
        hook("vllm", "0.33.0", "capture_graph")


def test_a_release_is_the_one_before_it_as_its_change_table_moves_it():
    """vLLM 0.34.0's rows are 0.33.0's as the change table moves them (data, not copies): a
    row it does not name is 0.33.0's but for its version; a moved row keeps its name unless
    renamed; a change naming a row the release before lacks is refused."""
    from dataclasses import replace

    from capture_plan.adapters.plugins.hook_point import GONE, follow
    from capture_plan.planner.inputs.releases import release

    changes = release("vllm", "0.34.0").changes
    assert release("vllm", "0.34.0").follows == "0.33.0"
    old = {h.name: h for h in HOOKS if (h.engine, h.version) == ("vllm", "0.33.0")}
    new = {h.name: h for h in HOOKS if (h.engine, h.version) == ("vllm", "0.34.0")}
    for name, h in old.items():
        if name not in changes:
            assert new[name] == replace(h, version="0.34.0")
    moved = hook("vllm", "0.34.0", "SpeculatorCudaGraphManager.capture")
    assert moved.file == "vllm/v1/worker/gpu/spec_decode/autoregressive/cudagraph_utils.py"
    assert "slot_mappings_buffer=None" in moved.signature
    assert "TargetDependentARSpeculator.capture" not in new and "AutoRegressiveSpeculator.capture" in new
    assert "has_lora" not in hook("vllm", "0.34.0", "ModelCudaGraphManager.capture").signature
    with pytest.raises(ValueError, match=r"changes name rows the release before lacks: \['capture_graph'\]"):
        follow(tuple(old.values()), "0.34.0", {"capture_graph": None})
    gone = follow(tuple(old.values()), "9.9", {"_MIN_PER_GRAPH_BYTES": GONE})
    assert "_MIN_PER_GRAPH_BYTES" not in {h.name for h in gone} and len(gone) == len(old) - 1


SOURCE = """
GROUP = "sglang.srt.plugins"

class Backend:
    LIMIT = 1 << 20
    num_tokens: int

    def __init__(self):
        self.pool = None

    def capture_one(self, shape_key, forward_fn, capture_inputs=None, *, hook=None, **kw):
        if shape_key:
            self.hidden: list = []
        other.graphs = {}

def profile(runner, /, extra=2, *rest):
    pass
"""


def _row(name: str, signature: str) -> HookPoint:
    return HookPoint("sglang", "9.9", "sglang/x.py", name, signature, "")


@pytest.mark.parametrize(
    ("name", "signature"),
    [
        ("GROUP", "= 'sglang.srt.plugins'"),
        ("Backend", "class"),
        ("Backend.LIMIT", "= 1 << 20"),
        ("Backend.capture_one", "(self, shape_key, forward_fn, capture_inputs=None, *, hook=None, **kw)"),
        ("profile", "(runner, /, extra=2, *rest)"),
        ("Backend.num_tokens", ": int"),
        ("Backend.pool", "attribute"),
        ("Backend.hidden", "attribute"),
    ],
)
def test_the_checker_accepts_what_the_source_defines(name, signature):
    assert contract.check_source(_row(name, signature), SOURCE) is None


@pytest.mark.parametrize(
    ("name", "signature", "says"),
    [
        ("capture_graph", "(self)", "'capture_graph' is not defined in sglang/x.py"),
        ("Backend.capture_full", "(self)", "'capture_full' is not defined in Backend"),
        ("Backend.capture_one", "(self, shape_key, forward_fn)", "is (self, shape_key, forward_fn, capture_inputs"),
        ("GROUP", "= 'vllm.general_plugins'", "is = 'sglang.srt.plugins', the table has"),
        ("Backend", "(self)", "is class, the table has (self)"),
        ("Backend.num_tokens", ": str", "is : int, the table has : str"),
        ("Backend.graphs", "attribute", "no method of Backend assigns self.graphs"),
        ("Gone.pool", "attribute", "'Gone' is not defined in sglang/x.py"),
        ("GROUP.pool", "attribute", "is = 'sglang.srt.plugins', the table has class"),
    ],
)
def test_the_checker_names_what_a_release_broke(name, signature, says):
    line = contract.check_source(_row(name, signature), SOURCE)
    assert line is not None and line.startswith(f"sglang 9.9 sglang/x.py: {name}: ") and says in line


def test_the_command_names_a_missing_wheel_and_exits_1(tmp_path, capsys):
    assert contract.main([str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert re.search(rf"sglang==0.5.23: no wheel in {re.escape(str(tmp_path))}; fix: pip download --no-deps", err)


# -- what docs/adoption.md names ----------------------------------------------------------------

ADOPTION = (ROOT / "docs" / "adoption.md").read_text()
#: a sketch's header: "Against `FILE` (ENGINE VERSION)", then its ```diff block
_SKETCH = re.compile(
    r"Against `(?P<file>[\w/.]+)` \((?P<engine>\w+) (?P<version>[\d.]+)\)(?:(?!Against `).)*?```diff\n(?P<diff>.*?)```",
    re.S,
)


def _sketches() -> list[tuple[str, str, str, list[str]]]:
    return [
        (m["engine"], m["version"], m["file"], [ln[1:].strip() for ln in m["diff"].splitlines() if ln.startswith("-")])
        for m in _SKETCH.finditer(ADOPTION)
    ]


def test_every_sketch_names_a_release_and_a_file_of_the_table():
    sketches = _sketches()
    assert len(sketches) == ADOPTION.count("```diff") >= 3  # every diff block has its header
    files = {(h.engine, h.version, h.file) for h in HOOKS}
    for engine, version, file, removed in sketches:
        assert (engine, version, file) in files and removed


def test_every_removed_line_of_the_sketches_is_in_the_release():
    missing = []
    for engine, version, file, removed in _sketches():
        lines = {ln.strip() for ln in wheel_source(engine, version, file).splitlines()}
        missing += [f"{engine} {version} {file}: {ln!r}" for ln in removed if ln not in lines]
    assert missing == [], "a sketch removes lines the release does not have"


def test_the_engine_names_the_guide_uses_are_hook_points():
    """A name of the engines' code in docs/adoption.md's prose is a row of HOOKS (so the
    contract test checks it), or capture-plan's own."""
    import builtins

    import capture_plan.executor as executor

    text = re.sub(r"```.*?```|<!-- table: hooks -->.*?<!-- /table -->", "", ADOPTION, flags=re.S)
    names = {h.name for h in HOOKS}
    groups = {h.signature.strip("= '") for h in HOOKS if h.name.endswith("PLUGINS_GROUP")}
    unknown = []
    for tok in sorted(set(re.findall(r"`([A-Za-z_][\w.]*)(?:\(\))?`", text))):
        first = tok.split(".")[0]
        if first[0].isupper() and not first.isupper():  # a class's name
            if tok not in names and first not in executor.__all__ and not hasattr(builtins, first):
                unknown.append(tok)
        elif tok.startswith(("sglang.", "vllm.")) and tok not in groups:
            unknown.append(tok)
        elif tok.startswith(("load_", "profile_")) and tok not in names:
            unknown.append(tok)
    assert unknown == [], "engine names in docs/adoption.md that are not rows of HOOKS"


# -- which wheels hold which release's rows (bench/engine_releases.py) -----------------------------


def test_the_release_table_names_the_rows_a_later_release_broke():
    """The wheels against every known release's rows: each known release holds its own
    rows whole, vLLM 0.34.0 breaks 6 of 0.33.0's (the ones its change table moves), and a
    wheel that holds no known release's rows whole is named (what the daily job fails on)."""
    from bench_modules import bench_module

    releases = bench_module("engine_releases")
    wheels = [contract.find_wheel(WHEELS, e, v) for e, v in RELEASES]
    if None in wheels:
        pytest.skip(f"the known releases' wheels are not all in {WHEELS} (.ci/run downloads them)")
    result = releases.compatibility(wheels)
    own = {(r["engine"], r["release"]): r for r in result if r["rows_of"] == r["release"]}
    assert set(own) == set(RELEASES) and all(not r["broken"] for r in own.values())
    (later,) = [r for r in result if (r["release"], r["rows_of"]) == ("0.34.0", "0.33.0")]
    assert [b["name"] for b in later["broken"]] == [
        "CudaGraphManager.__init__",
        "CudaGraphManager.capture",
        "ModelCudaGraphManager.capture",
        "SpeculatorCudaGraphManager",
        "SpeculatorCudaGraphManager.capture",
        "TargetDependentARSpeculator.capture",
    ]
    assert releases.unfollowed(result) == []
    assert releases.unfollowed([{**later, "release": "0.35.0", "known": False}]) == ["vllm 0.35.0"]
    lines = releases.table(result)
    assert "| vllm 0.34.0 | vllm 0.33.0 | 48 of 54 | `CudaGraphManager.__init__`" in "\n".join(lines)


def test_the_daily_workflow_runs_the_release_check():
    yaml = pytest.importorskip("yaml")
    flow = yaml.safe_load((ROOT / "docs" / "ci" / "engine-releases.yml").read_text())
    assert flow[True]["schedule"][0]["cron"]  # `on:` reads as True in YAML 1.1
    (run,) = [s["run"] for s in flow["jobs"]["contract"]["steps"] if "engine_releases" in s.get("run", "")]
    assert "python -m bench.engine_releases --wheels" in run and "--offline" not in run


# -- bench/baselines.py follows vLLM 0.34.0's size rules -----------------------------------------


def _wheel_functions(engine: str, version: str, file: str, names: tuple[str, ...]) -> dict:
    """``names`` defined in ``file`` of the release's wheel, run here (their source, as released)."""
    import ast
    import bisect
    import math
    from collections.abc import Callable, Iterable, Mapping

    tree = ast.parse(wheel_source(engine, version, file))
    nodes = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in names]
    assert {n.name for n in nodes} == set(names)
    scope: dict = {"math": math, "bisect": bisect, "Callable": Callable, "Iterable": Iterable, "Mapping": Mapping}
    exec(compile(ast.Module(body=nodes, type_ignores=[]), file, "exec"), scope)
    return scope


def test_the_baselines_size_rules_are_vllm_034s():
    from bench_modules import bench_module

    b = bench_module("baselines")
    fns = _wheel_functions(
        "vllm",
        "0.34.0",
        "vllm/config/compilation.py",
        (
            "_walk_grid",
            "decode_cudagraph_capture_grid",
            "prefill_cudagraph_capture_grid",
            "decode_cudagraph_capture_shapes",
        ),
    )
    for n in (1, 2, 7, 64, 100, 256, 512, 1000, 1024, 4096):
        assert b.vllm_decode_grid(n) == fns["decode_cudagraph_capture_grid"](n), n
        for dense in (False, True):
            assert b.vllm_prefill_grid(n * 8, dense) == fns["prefill_cudagraph_capture_grid"](n * 8, dense), n
    sizes = [1, 2, 4, 8, 16, 24, 32, 40, 100, 256, 512, 1024]
    for query_lens, max_tokens in (({1: 1024}, 512), ({4: 1024}, 1024), ({2: 64, 3: 32}, 96), ({1: 8}, 8)):
        assert b.vllm_decode_shapes(sizes, query_lens, max_tokens) == fns["decode_cudagraph_capture_shapes"](
            sizes, query_lens, max_tokens
        )
    assert len(b.vllm_decode_grid(1024)) == 64 and len(fns["prefill_cudagraph_capture_grid"](8192)) == 54
    # an H200 without speculative decoding: 0.33.0's 51 sizes both ways; EAGLE with 3 tokens:
    # 64 draft decode graphs up to max_num_seqs (0.33.0: 51 up to 512)
    plain = b.vllm_034_sizes()
    assert plain.prefill_tokens == b.vllm_capture_sizes() and [n for n, _ in plain.decode] == b.vllm_capture_sizes()
    assert plain.draft_decode == []
    eagle = b.vllm_034_sizes(num_speculative_tokens=3)
    assert len(eagle.draft_decode) == 64 and eagle.draft_decode[-1] == 1024
    assert {q for _, q in eagle.decode} == {4}
    assert b.vllm_persistent_rows("0.33.0", 256, 512) == 256 and b.vllm_persistent_rows("0.34.0", 256, 512) == 512


def test_every_known_vllm_release_has_its_facts_in_the_preset():
    """The plugin shapes its capture by the release file's [facts] (one table of these facts,
    which the preset reads): every release the hook rows know has one, 0.33.0's persistent
    buffer is the one [capture] (the facts the --preset vllm spec follows) states, and whether
    the KV cache is sized after capture is the fit rule's kind (its one owner)."""
    from capture_plan.adapters.plugins import vllm as vllm_plugin
    from capture_plan.planner.fit.tables import rule_for
    from capture_plan.planner.inputs.specs import engine_preset

    preset = engine_preset("vllm")
    assert sorted(preset.releases) == sorted(KNOWN["vllm"])
    assert preset.releases[preset.capture.release].persistent_buffer == "first-warmup"  # what the preset models
    assert vllm_plugin.shape_of("0.34.0").persistent_buffer == "widest"
    assert rule_for("vllm==0.34.0")[3].kind == "vllm-after-capture"
    assert rule_for("vllm==0.33.0")[3].kind == "vllm-before-capture"


def test_the_committed_release_table_is_what_the_wheels_give_now():
    """docs/adoption.md's table renders the latest bench/results/engine-releases-*.json: with
    the known releases' wheels at hand, it is what bench/engine_releases computes from them
    with the rows as they are now (a row changed since: rerun ``python -m bench.engine_releases
    --offline --wheels DIR --write``)."""
    import json

    from bench_modules import bench_module

    wheels = [contract.find_wheel(WHEELS, e, v) for e, v in RELEASES]
    if None in wheels:
        pytest.skip(f"the known releases' wheels are not all in {WHEELS} (.ci/run downloads them)")
    latest = sorted((ROOT / "bench" / "results").glob("engine-releases-*.json"))[-1]
    committed = json.loads(latest.read_text())["releases"]
    assert bench_module("engine_releases").compatibility(wheels) == committed, latest.name
