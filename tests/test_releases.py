"""An engine release is one data file (planner/data/releases/ENGINE-VERSION.toml): a release
added by its file alone, with no other edit, is seen by every consumer.

The added release is vLLM 0.35.0, following 0.34.0 with one hook renamed
(``VllmConfig.get_draft_decode_cudagraph_request_sizes`` -> ``...draft_decode_...``) and
0.34.0's facts and fit rule. Its file sits in a temporary folder appended to
``releases.DIRS`` in a fresh interpreter (the consumers read the files at import, so the
folder is added before anything imports them): the hook table (HOOKS, KNOWN,
requirements), the contract check (against a wheel made of 0.34.0's files with the rename),
the preset's facts, the docs' hook and fit tables, fit's rule lookup and wheel, the benches'
baselines (bench/baselines.py) and the fake runner (tests/engines/plugged.py), both by the
release's facts, and the vLLM plugin tests of tests/test_plugins.py, every one that runs per
release, on 0.35.0.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
OLD, NEW = "VllmConfig.get_draft_decode_cudagraph_request_sizes", "VllmConfig.draft_decode_cudagraph_request_sizes"
WHEEL = "vllm-0.35.0-cp38-abi3-manylinux_2_28_x86_64.whl"


def _wheel(folder: Path, rename: bool) -> str:
    """0.35.0's wheel as far as its hook rows read it: 0.34.0's files that the rows name, the
    renamed method renamed where ``rename``; its sha256."""
    from capture_plan.adapters.plugins.hooks import HOOKS
    from test_engine_contract import wheel_source

    files = {h.file for h in HOOKS if (h.engine, h.version) == ("vllm", "0.34.0")}
    texts = {name: wheel_source("vllm", "0.34.0", name) for name in sorted(files)}
    path = folder / WHEEL
    with zipfile.ZipFile(path, "w") as out:
        for name, text in texts.items():
            if rename:
                text = text.replace(f"def {OLD.split('.')[1]}(", f"def {NEW.split('.')[1]}(")
            out.writestr(name, text)
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _release_file(folder: Path, sha256: str) -> Path:
    """vllm-0.35.0.toml: 0.34.0's file with the version, what it follows, the wheel and a
    change table of one rename."""
    text = (ROOT / "planner/data/releases/vllm-0.34.0.toml").read_text()
    text = text[: text.index("\n[changes.")]  # 0.34.0's facts and fit rule stay; its rows follow
    text = text.replace('version = "0.34.0"', 'version = "0.35.0"').replace('follows = "0.33.0"', 'follows = "0.34.0"')
    text = re.sub(r'\[wheel\]\nfile = ".*"\nsha256 = ".*"', f'[wheel]\nfile = "{WHEEL}"\nsha256 = "{sha256}"', text)
    path = folder / "vllm-0.35.0.toml"
    path.write_text(f'{text}\n\n[changes."{OLD}"]\nname = "{NEW}"\n')
    return path


CHECKS = """
import json, sys
from pathlib import Path
from capture_plan.planner.inputs import releases
releases.DIRS.append(Path(sys.argv[1]))
from capture_plan.adapters.plugins import contract, hooks
from capture_plan.planner.fit.tables import rule_for, wheels
from capture_plan.planner.inputs.specs import engine_preset
sys.path[:0] = ["docs", "tests"]
import generate
from bench import baselines
try:  # the fake runners are torch code: without torch (the Quickstart's run) the data alone is checked
    import torch  # noqa: F401
except ModuleNotFoundError:
    plugged = None
else:
    from engines import plugged
rows = [h for h in hooks.HOOKS if (h.engine, h.version) == ("vllm", "0.35.0")]
print(json.dumps({
    "known": hooks.KNOWN["vllm"],
    "requirements": hooks.requirements(),
    "names": [h.name for h in rows],
    "rows": len(rows),
    "rows_034": sum((h.engine, h.version) == ("vllm", "0.34.0") for h in hooks.HOOKS),
    "contract": contract.check_folder(sys.argv[2], rows),
    "contract_unrenamed": contract.check_folder(sys.argv[3], rows),
    "facts": engine_preset("vllm").releases["0.35.0"].persistent_buffer,
    "fit_rule": rule_for("vllm==0.35.0")[2],
    "fit_wheel": wheels()["vllm==0.35.0"].sha256,
    "docs_hooks": [line for line in generate.hooks() if "vllm 0.35.0" in line and sys.argv[4] in line],
    "docs_fit": [line for line in generate.fit_rules() if "0.35.0" in line],
    "baselines_rows": baselines.vllm_persistent_rows("0.35.0", 1, 5),
    "runner": plugged and [p.name for p in plugged.later("vllm", "0.35.0")],
    "runner_releases": plugged and plugged.VLLM_RELEASES,
}))
"""


def test_a_release_added_by_its_file_alone_is_seen_everywhere(tmp_path):
    good, bad, extra = tmp_path / "wheel", tmp_path / "unrenamed", tmp_path / "releases"
    for d in (good, bad, extra):
        d.mkdir()
    sha = _wheel(good, rename=True)
    _wheel(bad, rename=False)
    _release_file(extra, sha)
    run = subprocess.run(
        [sys.executable, "-c", CHECKS, str(extra), str(good), str(bad), NEW],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    import json

    got = json.loads(run.stdout)
    assert got["known"][-2:] == ["0.34.0", "0.35.0"] and "vllm==0.35.0" in got["requirements"]
    assert NEW in got["names"] and OLD not in got["names"] and got["rows"] == got["rows_034"]
    assert got["contract"] == [[], []]  # its wheel holds every row, renamed one included
    (problems, missing) = got["contract_unrenamed"]
    assert missing == [] and len(problems) == 1 and NEW in problems[0]
    assert got["facts"] == "widest"
    assert got["fit_rule"] == "vllm-extensible" and got["fit_wheel"] == sha
    assert len(got["docs_hooks"]) == 1 and got["docs_fit"]
    assert got["baselines_rows"] == 5  # bench/baselines.py: by its facts, 0.34.0's (the widest descriptor's rows)
    if importlib.util.find_spec("torch") is not None:
        assert got["runner"] == ["vllm_runner_034.py", "vllm_worker_034.py"]  # by its facts, 0.34.0's
        assert got["runner_releases"][-1] == "0.35.0"


def test_the_vllm_plugin_tests_run_on_a_release_added_by_its_file_alone(tmp_path):
    """tests/test_plugins.py's per-release vLLM tests, on 0.35.0 (the plugin routes the fake
    runner the release's facts pick, through the release's hook rows)."""
    pytest.importorskip("torch")  # tests/test_plugins.py needs it: without it the run collects nothing
    extra = tmp_path / "releases"
    extra.mkdir()
    _release_file(extra, "0" * 64)
    (tmp_path / "extra_release.py").write_text(
        textwrap.dedent(f"""
        from pathlib import Path
        from capture_plan.planner.inputs import releases
        releases.DIRS.append(Path({str(extra)!r}))
        """)
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "extra_release", "-p", "no:cacheprovider", "-p", "no:xdist", "-q"]
        + ["tests/test_plugins.py", "-k", "0.35.0"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    summary = run.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "deselected" in summary, summary
    assert int(summary.split(" passed")[0].split()[-1]) >= 20, summary


def test_the_preset_refuses_a_capture_release_whose_buffer_it_does_not_model(monkeypatch):
    """presets_vllm.toml's [capture] no longer restates the persistent buffer: the release it was
    read from says it (its file's persistent_buffer), and the preset, which models the first
    warm-up's buffer, refuses a release file that says otherwise (a broken package)."""
    import msgspec

    from capture_plan.planner.inputs import releases, specs

    def widest(r):
        if (r.engine, r.version) != ("vllm", "0.33.0"):
            return r
        return msgspec.structs.replace(r, facts=msgspec.structs.replace(r.facts, persistent_buffer="widest"))

    assert specs.engine_preset("vllm").releases["0.33.0"].persistent_buffer == "first-warmup"
    edited = tuple(map(widest, releases.releases()))
    monkeypatch.setattr(releases, "releases", lambda: edited)
    with pytest.raises(RuntimeError, match=r"capture.release 0.33.0's release file has persistent_buffer = 'widest'"):
        specs.engine_preset("vllm")
