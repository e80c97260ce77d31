"""The CI integration (issue 19): the pre-commit hook of .pre-commit-hooks.yaml,
run by pre-commit's ``try-repo`` against this repository in a temporary git
repository, and the GitHub Actions example (docs/ci/capture-plans.yml), whose
check and diff steps run here in a temporary repository with a base branch.

pre-commit (and the PyYAML it brings) is in the ``test`` extra; where it is
missing these tests skip and say so.
"""

from __future__ import annotations

import json
import os
import re
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
    assert (
        "plans/fa3.json: predicted total (pools + hoisted; no device total in either plan) grew "
        "258.0 MiB -> 2,078.0 MiB" in diff.stderr
    )
    body = (repo / "plan-diff.md").read_text()
    assert "### Capture plan `plans/fa3-ci.json` removed" in body, _git(repo, "diff", "--name-status", "main...HEAD")
    assert "### Capture plan `plans/fa3.json` vs `.plan-base/plans/fa3.json`" in body
    assert (
        "**Over the limit**: predicted total (pools + hoisted; no device total in either plan) grew "
        "258.0 MiB -> 2,078.0 MiB (+1,820.0 MiB, +705.4%), above "
        "--fail-above 5%" in body
    )
    assert (
        "| **total (pools + hoisted) = pools at peak = pool shared = phase adds decode = device item pool** | "
        "258.0 MiB | 2,078.0 MiB | **+1,820.0 MiB, +705.4%** |" in body
    )
    assert "### New capture plan `plans/triton.json`" in body and "plans/triton.json: 36 captures" in body
    assert out.read_text() == "changed=true\n"
    assert not (repo / ".plan-base").exists()


def test_the_workflow_installs_capture_plan_from_its_repository_pinned(tmp_path):
    """The install step, run with this repository's URL and commit: pip clones it at that
    commit and builds capture-plan from it (into a folder of its own: no dependencies, no
    index, so nothing but the named repository can be installed)."""
    steps = _steps()
    yaml = pytest.importorskip("yaml")
    flow = yaml.safe_load((ROOT / "docs/ci/capture-plans.yml").read_text())
    step = steps["Install capture-plan"]["run"]
    assert step == 'pip install "capture-plan @ git+${CAPTURE_PLAN_REPO}@${CAPTURE_PLAN_REF}"'
    assert re.fullmatch(r"https://\S+", flow["env"]["CAPTURE_PLAN_REPO"])
    assert re.fullmatch(r"[0-9a-f]{40}", flow["env"]["CAPTURE_PLAN_REF"])  # a commit: the same install every time
    for text in (step, (ROOT / "docs/ci.md").read_text(), (ROOT / "README.md").read_text()):
        assert not re.search(r"pip install ['\"]?capture-plan\b(?! @)", text), text  # never the bare PyPI name
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    pytest.importorskip("setuptools", minversion="77", reason="building the wheel needs setuptools>=77 offline")
    commit = _git(ROOT, "rev-parse", "HEAD").strip()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "pip").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m pip "$@"\n')
    (bin_dir / "pip").chmod(0o755)
    site = tmp_path / "site"
    env = {
        "CAPTURE_PLAN_REPO": f"file://localhost{ROOT}",  # pip 23 reads file:///path@rev as a path
        "CAPTURE_PLAN_REF": commit,
        "PIP_TARGET": str(site),
        "PIP_NO_DEPS": "1",
        "PIP_NO_INDEX": "1",
        "PIP_NO_BUILD_ISOLATION": "0",  # pip's inverted switch: build with this interpreter's setuptools
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    done = subprocess.run(["bash", "-c", step], capture_output=True, text=True, env={**os.environ, **env})
    assert done.returncode == 0, done.stdout + done.stderr
    installed = site / "capture_plan" / "planner" / "build.py"
    assert installed.read_text() == _git(ROOT, "show", f"{commit}:planner/build.py")


_FAKE_GH = r'''#!PYTHON
"""`gh api` as the comment step calls it, over comments kept in $GH_STATE (two per page)."""
import json, os, subprocess, sys

assert os.environ.get("GH_TOKEN"), "no GH_TOKEN"
args = sys.argv[1:]
assert args[0] == "api", args
args = args[1:]
method, jq, body, paginate, endpoint = "GET", None, None, False, None
while args:
    a = args.pop(0)
    if a == "--method":
        method = args.pop(0)
    elif a == "--jq":
        jq = args.pop(0)
    elif a == "--paginate":
        paginate = True
    elif a == "-F":
        key, _, value = args.pop(0).partition("=")
        assert key == "body" and value.startswith("@"), a
        body = open(value[1:]).read()
    else:
        assert endpoint is None, a
        endpoint = a
state = json.load(open(os.environ["GH_STATE"]))
issue = "repos/o/r/issues/7/comments"
if method == "GET":
    assert endpoint == issue and paginate, endpoint
    pages = [state[i : i + 2] for i in range(0, len(state), 2)] or [[]]
    for page in pages:
        text = json.dumps(page)
        if jq:
            text = subprocess.run(["jq", "-r", jq], input=text, capture_output=True, text=True, check=True).stdout
        sys.stdout.write(text)
elif method == "POST":
    assert endpoint == issue and body is not None
    state.append({"id": 100 + len(state), "user": {"login": "github-actions[bot]"}, "body": body})
elif method == "PATCH":
    prefix = "repos/o/r/issues/comments/"
    assert endpoint.startswith(prefix) and body is not None
    [c] = [c for c in state if str(c["id"]) == endpoint[len(prefix):]]
    c["body"] = body
json.dump(state, open(os.environ["GH_STATE"], "w"))
'''


def test_the_workflow_keeps_one_pr_comment_and_edits_it_on_every_push(tmp_path):
    """The comment step against a stand-in for `gh api` (the real one needs GitHub): the first
    run posts the diff, every later run edits that comment; another user's comment that quotes
    the marker, and the bot's other comments, are left alone."""
    if shutil.which("jq") is None:
        pytest.skip("jq is not installed (the stand-in for `gh api --jq` runs it)")
    step = _steps()["Post the diff as a PR comment"]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "gh").write_text(_FAKE_GH.replace("PYTHON", sys.executable, 1))
    (bin_dir / "gh").chmod(0o755)
    marker = "<!-- capture-plans: planner diff -->"
    state = tmp_path / "comments.json"
    others = [
        {"id": 1, "user": {"login": "someone"}, "body": f"{marker}\nquoted"},
        {"id": 2, "user": {"login": "github-actions[bot]"}, "body": "another workflow's comment"},
        {"id": 3, "user": {"login": "someone"}, "body": "lgtm"},
    ]
    state.write_text(json.dumps(others))
    work = tmp_path / "work"
    work.mkdir()
    env = {
        **{k: v.replace("${{ github.repository }}", "o/r") for k, v in step["env"].items()},
        "GH_TOKEN": "t",
        "GH_STATE": str(state),
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    env["ISSUE"] = env["ISSUE"].replace("${{ github.event.pull_request.number }}", "7")
    for push in ("first diff\n", "second diff\n", "third diff\n"):
        (work / "plan-diff.md").write_text(push)
        done = subprocess.run(["bash", "-c", step["run"]], cwd=work, capture_output=True, text=True, env=env)
        assert done.returncode == 0, done.stdout + done.stderr
        comments = json.loads(state.read_text())
        assert comments[:3] == others
        assert [c["body"] for c in comments[3:]] == [f"{marker}\n{push}"]


#: an install line that names capture-plan by itself: an index would serve whatever package took the name
BARE = re.compile(r"""pip install\s+(?:-\S+\s+)*['"]?capture[-_]plan\b(?!\S*\s*@)""")


def test_no_install_line_names_capture_plan_bare_in_the_docs_or_the_fixes():
    """Issue 40, item 4: docs/adoption.md said `pip install 'capture-plan[executor]'` and
    `planner sizes --plot`'s fix `pip install 'capture-plan[plot]'`: no index serves the project.
    Every install line the project documents or prints installs from its repository (the pinned
    git URL of docs/ci) or a checkout, or names a dependency itself."""
    texts = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "docs/ci").glob("*"))]
    code = [
        p
        for folder in ("planner", "executor", "adapters", "schemas", "references")
        for p in sorted((ROOT / folder).rglob("*.py"))
    ]
    found = [
        f"{p.relative_to(ROOT)}:{n}: {line.strip()}"
        for p in texts + code
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if BARE.search(line)
    ]
    assert not found, found
    assert BARE.search("pip install 'capture-plan[plot]'") and BARE.search("pip install -q capture_plan")
    assert not BARE.search('pip install "capture-plan[executor] @ git+${CAPTURE_PLAN_REPO}@${CAPTURE_PLAN_REF}"')


def test_the_plot_fixes_install_the_dependency_they_lack(monkeypatch, tmp_path):
    """`planner sizes --plot` and `planner plot` without matplotlib: one fix, the dependency's."""
    import builtins

    from capture_plan.planner.report.plot import INSTALL_MATPLOTLIB
    from capture_plan.planner.report.size_plot import draw_front
    from capture_plan.schemas.errors import InputError

    real = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with pytest.raises(InputError) as err:
        draw_front({"phases": []}, tmp_path / "f.png")
    assert err.value.fix == INSTALL_MATPLOTLIB == "pip install 'matplotlib>=3.7'"


# CI's own steps (issue 49) ---------------------------------------------------------------------


def _load_ci_script(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name.removesuffix(".py"), ROOT / ".ci" / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_ci_downloads_each_engine_pin_in_a_pip_command_of_its_own(monkeypatch, tmp_path, capsys):
    """pip refuses two versions of one distribution in one command, so the single command CI ran
    downloaded nothing and the wheel contract skipped on every clean clone: each pin is its own
    command now, and a pin pip cannot fetch fails the step, naming it."""
    from capture_plan.adapters.plugins.hooks import requirements

    wheels = _load_ci_script("engine_wheels.py")
    assert wheels.pins(sys.executable) == requirements()
    assert len({p.split("==")[0] for p in requirements()}) < len(requirements())  # two vllm pins: the case
    calls: list[list[str]] = []

    def fake_run(cmd, *a, **kw):
        if cmd[1:3] == ["-m", "capture_plan.adapters.plugins.hooks"]:
            return subprocess.CompletedProcess(cmd, 0, stdout=" ".join(requirements()) + "\n")
        calls.append(cmd)
        # pip's behaviour: two versions of one distribution in one command cannot be resolved
        names = [a.split("==")[0] for a in cmd if "==" in a]
        return subprocess.CompletedProcess(cmd, 1 if len(names) != len(set(names)) else 0)

    monkeypatch.setattr(wheels.subprocess, "run", fake_run)
    assert wheels.main([str(tmp_path)]) == 0
    assert [c[-1] for c in calls] == requirements()
    assert all(c[c.index("-d") + 1] == str(tmp_path) and "--no-deps" in c for c in calls)

    def failing(cmd, *a, **kw):
        if "vllm==0.34.0" in cmd:
            return subprocess.CompletedProcess(cmd, 7)
        return fake_run(cmd)

    monkeypatch.setattr(wheels.subprocess, "run", failing)
    assert wheels.main([str(tmp_path)]) == 7
    assert "pip download of vllm==0.34.0 failed (exit 7)" in capsys.readouterr().err


def test_ci_runs_the_contract_where_the_wheels_are_and_allows_only_gpu_skips():
    """The wheels are downloaded into the contract's default folder before the full suite, which
    runs strict: a wheel test that skips there fails CI instead of passing silently."""
    from test_engine_contract import WHEELS

    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    download = next(i for i, line in enumerate(lines) if "python .ci/engine_wheels.py" in line)
    assert "ENGINE_WHEELS=.cache/engine-wheels" in lines and '"$ENGINE_WHEELS"' in lines[download]
    assert "CAPTURE_PLAN_ENGINE_WHEELS" in os.environ or WHEELS == ROOT / ".cache" / "engine-wheels"
    suite = lines.index("CAPTURE_PLAN_ONLY_GPU_SKIPS=1 .venv/bin/python -m pytest -q")
    assert download < suite
    # no install CI needs may fall through to a message: that turned whole suites into skips
    run = "\n".join(lines)
    assert "|| echo" not in run and "else\n  echo" not in run


def test_a_strict_run_fails_on_a_skip_that_is_not_for_want_of_a_gpu(tmp_path):
    shutil.copy(ROOT / "tests" / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_x.py").write_text(
        "import pytest\n"
        "def test_no_wheel():\n    pytest.skip('no vllm-0.34.0 wheel in .cache')\n"
        "@pytest.mark.gpu\ndef test_gpu():\n    pass\n"
        "def test_ok():\n    pass\n"
    )
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: needs CUDA\n")
    env = {k: v for k, v in os.environ.items() if k != "CAPTURE_PLAN_ONLY_GPU_SKIPS"}

    def pytest_run(strict: bool, *only: str):
        e = {**env, "CAPTURE_PLAN_ONLY_GPU_SKIPS": "1"} if strict else env
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *only]
        return subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, env=e)

    assert pytest_run(False).returncode == 0
    strict = pytest_run(True)
    assert strict.returncode == 1, strict.stdout
    assert "test_x.py::test_no_wheel: Skipped: no vllm-0.34.0 wheel in .cache" in strict.stdout
    assert "test_gpu" not in strict.stdout.split("skips that CI does not allow")[1]
    # where the only skips are for want of a GPU (or none at all), a strict run passes
    assert pytest_run(True, "test_x.py::test_gpu", "test_x.py::test_ok").returncode == 0
    # a module that skips whole at collection (its package missing) fails a strict run too
    (tmp_path / "test_y.py").write_text("import pytest\npytest.importorskip('no_such_package_here')\n")
    whole = pytest_run(True, "test_y.py", "test_x.py::test_ok")
    assert whole.returncode == 1, whole.stdout
    assert re.search(r"test_y\.py: .*could not import 'no_such_package_here'", whole.stdout), whole.stdout
