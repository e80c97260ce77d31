"""The CI integration (issue 19): the pre-commit hook of .pre-commit-hooks.yaml,
run by pre-commit's ``try-repo`` against this repository in a temporary git
repository, and the GitHub Actions example (docs/ci/capture-plans.yml), whose
check and diff steps run here in a temporary repository with a base branch.

pre-commit (and the PyYAML it brings) is in the ``test`` extra; where it is
missing these tests skip and say so.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _git(repo: Path, *args: str) -> str:
    env = {
        **os.environ,
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@t",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@t",
    }
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True, env=env).stdout


def _repo(tmp_path: Path) -> Path:
    repo = tmp_path / "engine"
    (repo / "plans").mkdir(parents=True)
    for name in ("fa3.json", "fa3-ci.json"):
        shutil.copy(ROOT / "plans" / name, repo / "plans" / name)
    # fa3-ci.json is calibrated from a device report: the plan records it as an input
    shutil.copytree(ROOT / "plans" / "calibration", repo / "plans" / "calibration")
    _git(repo, "init", "-q", "-b", "main")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "plans")
    return repo


def _planner(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "planner"), *args], cwd=cwd, capture_output=True, text=True)


# pre-commit --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pre_commit_home(tmp_path_factory):
    if shutil.which("pre-commit", path=str(BIN)) is None and shutil.which("pre-commit") is None:
        pytest.skip("pre-commit is not installed (pip install -e '.[test]' installs it)")
    return tmp_path_factory.mktemp("pre-commit-home")


def _try_repo(repo: Path, home: Path) -> subprocess.CompletedProcess:
    exe = shutil.which("pre-commit", path=str(BIN)) or shutil.which("pre-commit")
    env = {**os.environ, "PRE_COMMIT_HOME": str(home), "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    return subprocess.run(
        [exe, "try-repo", str(ROOT), "planner-check", "--all-files"], cwd=repo, capture_output=True, text=True, env=env
    )


def test_the_hook_definition_names_planner_check():
    yaml = pytest.importorskip("yaml")
    hooks = yaml.safe_load((ROOT / ".pre-commit-hooks.yaml").read_text())
    assert [h["id"] for h in hooks] == ["planner-check"]
    hook = hooks[0]
    assert (hook["entry"], hook["args"], hook["pass_filenames"], hook["language"]) == (
        "planner check",
        ["plans"],
        False,
        "python",
    )


def test_pre_commit_try_repo_passes_fresh_plans_and_fails_a_stale_one(tmp_path, pre_commit_home):
    repo = _repo(tmp_path)
    (repo / "my.toml").write_text('[[phases]]\nname = "decode"\nkind = "decode"\nsizes = [1, 2, 4, 8]\n')
    assert _planner("build", "-b", "fa3", "--spec", "my.toml", "-o", "plans/mine.json", cwd=repo).returncode == 0
    _git(repo, "add", "-A")
    done = _try_repo(repo, pre_commit_home)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Passed" in done.stdout
    # the spec changes and its plan is not rebuilt: the hook names the plan, the input and the fix
    (repo / "my.toml").write_text('[[phases]]\nname = "decode"\nkind = "decode"\nsizes = [1, 2, 4, 8, 16]\n')
    done = _try_repo(repo, pre_commit_home)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Failed" in done.stdout
    assert "planner: error: plans/mine.json: plan is stale: changed: spec: ../my.toml (" in done.stdout
    assert (
        "fix: run `planner build --backend fa3 --spec my.toml -o plans/mine.json`, or `planner check --fix`"
        in done.stdout
    )


# the GitHub Actions example ------------------------------------------------------------------------


def _steps() -> dict[str, dict]:
    yaml = pytest.importorskip("yaml")
    flow = yaml.safe_load((ROOT / "docs/ci/capture-plans.yml").read_text())
    return {s["name"]: s for s in flow["jobs"]["plans"]["steps"] if "name" in s}


def _run_step(step: dict, repo: Path, env: dict) -> subprocess.CompletedProcess:
    path = f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"
    return subprocess.run(
        ["bash", "-c", step["run"]], cwd=repo, capture_output=True, text=True, env={**os.environ, "PATH": path, **env}
    )


def test_the_workflow_checks_plans_and_posts_the_diff(tmp_path):
    steps = _steps()
    assert set(steps) >= {
        "Plans are what the planner builds",
        "Diff plans against the base branch",
        "Post the diff as a PR comment",
    }
    repo = _repo(tmp_path)
    _git(repo, "checkout", "-q", "-b", "pr")
    # the PR: fa3.json now captures smallest-first (+705%), a new plan, fa3-ci.json removed
    for args in (
        ("-b", "fa3", "-s", "order=smallest-first", "-o", "plans/fa3.json", "--force"),
        ("-b", "triton", "-o", "plans/triton.json"),
    ):
        assert _planner("build", *args, cwd=repo).returncode == 0
    (repo / "plans/fa3-ci.json").unlink()
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "pr")

    check = _run_step(steps["Plans are what the planner builds"], repo, {})
    assert check.returncode == 0, check.stderr
    assert check.stdout.splitlines() == ["plans/fa3.json: up to date", "plans/triton.json: up to date"]

    out = tmp_path / "github-output"
    step = steps["Diff plans against the base branch"]
    assert step["env"]["BASE"] == "origin/${{ github.base_ref }}"
    diff = _run_step(step, repo, {"BASE": "main", "FAIL_ABOVE": step["env"]["FAIL_ABOVE"], "GITHUB_OUTPUT": str(out)})
    assert diff.returncode == 1, diff.stderr  # fa3.json grew more than 5%
    assert "plans/fa3.json: predicted total grew 258.0 MiB -> 2,078.0 MiB" in diff.stderr
    body = (repo / "plan-diff.md").read_text()
    assert "### Capture plan `plans/fa3-ci.json` removed" in body, _git(repo, "diff", "--name-status", "main...HEAD")
    assert "### Capture plan `plans/fa3.json` vs `.plan-base/plans/fa3.json`" in body
    assert (
        "**Over the limit**: predicted total grew 258.0 MiB -> 2,078.0 MiB (+1,820.0 MiB, +705.4%), above "
        "--fail-above 5%" in body
    )
    assert (
        "| **total (pools + hoisted) = pools at peak = pool shared = phase adds decode = device item pool** | "
        "258.0 MiB | 2,078.0 MiB | **+1,820.0 MiB, +705.4%** |" in body
    )
    assert "### New capture plan `plans/triton.json`" in body and "plans/triton.json: 36 captures" in body
    assert out.read_text() == "changed=true\n"
    assert not (repo / ".plan-base").exists()
