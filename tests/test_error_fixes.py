"""Every error whose fix names a command: that command, run as the user would run it
(a shell, in the directory the failing command ran in), works, and afterwards the
failing command (or the check it stands for) passes.

One case per error class that suggests a ``planner`` command (the commands are
read from the error line's backticks after "; fix: "); each case is run from the
folder above the plans and from another folder, where the plans are ``../plans``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from cli_inputs import SPEC, reseal

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def sh(command: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    return subprocess.run(["bash", "-c", command], cwd=cwd, capture_output=True, text=True, env=env)


def fixes(err: str) -> list[str]:
    """The commands an error line's fix names."""
    assert err.startswith("planner: error: ") and err.count("\n") == 1, err
    return re.findall(r"`(planner [^`]*)`", err.partition("; fix: ")[2])


@dataclass
class Case:
    #: makes the repository state under ``repo`` (its plans/ folder and specs)
    setup: Callable[[Path], None]
    #: the failing command, ``{plans}`` standing for the plans folder as seen from the cwd
    command: str
    #: what must pass after the fix (None: the command itself; "": only the fix)
    then: str | None = None


def _copy(repo: Path, *names: str) -> None:
    (repo / "plans").mkdir(parents=True, exist_ok=True)
    for name in names:
        shutil.copy(ROOT / "plans" / name, repo / "plans" / name)


def _edit_plan(repo: Path, name: str, change: Callable[[dict], None], *, seal: bool) -> None:
    path = repo / "plans" / name
    raw = json.loads(path.read_text())
    change(raw)
    path.write_bytes(reseal(raw) if seal else json.dumps(raw).encode())


def _stale_spec(repo: Path) -> None:
    (repo / "plans").mkdir(parents=True)
    (repo / "my.toml").write_text(SPEC)
    assert sh("planner build -b fa3 --spec my.toml -o plans/mine.json", repo).returncode == 0
    (repo / "my.toml").write_text(SPEC.replace("[1, 2]", "[1, 2, 4]"))


def _two_stale(repo: Path) -> None:
    _stale_spec(repo)
    shutil.copy(repo / "plans/mine.json", repo / "plans/other.json")


def _revision_1(repo: Path) -> None:
    _copy(repo, "fa3-ci.json")

    def old(raw):
        raw["revision"] = 1
        del raw["inputs"]["build"]

    _edit_plan(repo, "fa3-ci.json", old, seal=True)


def _revision_1_with_paths(repo: Path) -> None:
    _stale_spec(repo)
    assert sh("planner build -b fa3 --spec my.toml -o plans/mine.json --force", repo).returncode == 0

    def old(raw):
        raw["revision"] = 1
        del raw["inputs"]["build"]

    _edit_plan(repo, "mine.json", old, seal=True)


def _hand_edited(repo: Path) -> None:
    _copy(repo, "fa3.json")
    _edit_plan(repo, "fa3.json", lambda raw: raw.update(name="edited"), seal=False)


def _plans(repo: Path) -> None:
    _copy(repo, "fa3.json")


def _not_a_plan(repo: Path) -> None:
    (repo / "plans").mkdir()
    (repo / "plans/fa3.json").write_text("{}\n")


def _spec_file(repo: Path) -> None:
    (repo / "x.toml").write_text(SPEC)


def _bad_spec(repo: Path) -> None:
    (repo / "bad.toml").write_text(SPEC.replace("sizes", "size"))
    (repo / "empty.toml").write_text("")


def _traffic(repo: Path) -> None:
    """Traffic files for ``planner build --sizes auto`` (tests/test_sizes_auto.py), good and bad."""
    (repo / "plans").mkdir()
    data = ROOT / "tests/data"
    (repo / "t.csv").write_bytes((data / "traffic-skewed.csv").read_bytes())
    (repo / "t.prom").write_bytes((data / "vllm-metrics.prom").read_bytes())
    (repo / "neg.csv").write_text("size,count\n1,5\n3,-2\n")
    (repo / "frac.csv").write_text("size,count\n1,5\n3,2.5\n")
    zero = [
        line.rpartition(" ")[0] + " 0" if line.startswith("vllm:iteration_tokens_total") else line
        for line in (data / "vllm-metrics.prom").read_text().splitlines()
    ]
    (repo / "zero.prom").write_text("\n".join(zero) + "\n")


def _traffic_gone(repo: Path) -> None:
    """A sizes plan beside another plan, its traffic file then deleted (issue 40, item 5)."""
    _traffic(repo)
    for args in ("--ci", "--ci --sizes auto --traffic t.csv"):
        assert sh(f"planner build -b fa3 {args}", repo).returncode == 0
    (repo / "t.csv").unlink()


def _other_model(repo: Path) -> None:
    """A spec of another model than the H200 calibration measured (issue 40, item 1)."""
    (repo / "plans").mkdir()
    (repo / "calibration").mkdir()
    shutil.copy(ROOT / "plans/calibration/h200-fa3-ci.json", repo / "calibration/h200.json")
    (repo / "x.toml").write_text('[model]\npreset = "llama-3-8b"\nlayers = 80\n' + SPEC)


def _traffic_more(repo: Path) -> None:
    _traffic(repo)
    (repo / "fw.csv").write_text("size,count\n1,\uff15\n")  # a full-width digit (item 8)


#: planner build --sizes auto with bad input: each fix (the command with the option that passes,
#: or the build of the spec's own sizes) must pass; the failing command still fails after it
_AUTO = "planner build -b fa3 --sizes auto --traffic {up}"

CASES = {
    # DriftError: a spec changed; `planner check` names the rebuild and `planner check --fix`
    "stale": Case(_stale_spec, "planner check {plans}"),
    "several stale": Case(_two_stale, "planner check {plans}"),
    # a revision-1 plan at its default path: the rebuild writes that path, not plans/plans/...
    "revision 1": Case(_revision_1, "planner check {plans}"),
    "revision 1 with a spec": Case(_revision_1_with_paths, "planner check {plans}"),
    # a plan edited by hand: checked, or shown
    "hand-edited, check": Case(_hand_edited, "planner check {plans}"),
    "hand-edited, show": Case(_hand_edited, "planner show {plans}/fa3.json"),
    # `build --check` of a what-if against the checked-in plan of the same default name
    "what-if --check": Case(_plans, "planner build -b fa3 --tp 2 -o {plans}/fa3.json --check", ""),
    # `build --check` where the file is missing, or is no plan
    "missing --check": Case(_plans, "planner build -b fa3 --ci -o {plans}/fa3-ci.json --check"),
    "not a plan --check": Case(_not_a_plan, "planner build -b fa3 -o {plans}/fa3.json --check"),
    # --spec with the embedded spec's options: start from `planner spec show ...`
    # (--spec with --preset builds since issue 49, item 10: the preset's sizes for the spec's model)
    "--spec and --max-bs": Case(
        _spec_file,
        "planner build -b fa3 --spec {spec} --max-bs 16 --dry-run",
        "planner build -b fa3 --spec my.toml --dry-run",
    ),
    "--spec and --speculative": Case(
        _spec_file,
        "planner build -b fa3 --spec {spec} --speculative eagle --max-bs 16 --dry-run",
        "planner build -b fa3 --spec my.toml --dry-run",
    ),
    # a spec the schema refuses: the schema command the fix names runs
    "bad spec": Case(_bad_spec, "planner build -b fa3 --spec {bad} --dry-run", ""),
    "empty spec": Case(_bad_spec, "planner build -b fa3 --spec {empty} --dry-run", ""),
    "traffic beyond --max-size": Case(_traffic, _AUTO + "t.csv --max-size 128 -o {plans}/auto.json", ""),
    "negative count": Case(_traffic, _AUTO + "neg.csv -o {plans}/auto.json", ""),
    "fractional count": Case(_traffic, _AUTO + "frac.csv -o {plans}/auto.json", ""),
    "empty histogram": Case(_traffic, _AUTO + "zero.prom -o {plans}/auto.json", ""),
    "scrape without the metric": Case(_traffic, _AUTO + "t.prom --metric vllm:nope -o {plans}/auto.json", ""),
    "budget no list meets": Case(_traffic, _AUTO + "t.csv --budget-mib 10 -o {plans}/auto.json", ""),
    "padding no list meets": Case(
        _traffic, _AUTO + "t.csv --max-graphs 4 --max-padding 0.001 -o {plans}/auto.json", ""
    ),
    # a calibration of another model: the fix's first step, the build without it (the capture is on a GPU)
    "calibration of another model": Case(
        _other_model, "planner build -b fa3 --spec {spec} --calibration {up}calibration/h200.json -o {plans}/x.json", ""
    ),
    # -o /dev/null: the dry run it was typed for
    "-o /dev/null": Case(_plans, "planner build -b fa3 -o /dev/null", ""),
    "full-width digit": Case(_traffic_more, _AUTO + "fw.csv -o {plans}/auto.json", ""),
    # the traffic a sizes plan records is gone: the build of the spec's sizes in its place (--force)
    "traffic gone, check": Case(_traffic_gone, "planner check {plans}"),
    # option values out of range (issue 40, items 2 and 3): the build without the option
    "--budget-mib 0": Case(_traffic, _AUTO + "t.csv --budget-mib 0 -o {plans}/auto.json", ""),
    "--budget-mib 1e30": Case(_traffic, _AUTO + "t.csv --budget-mib 1e30 -o {plans}/auto.json", ""),
    "--budget-mib nan": Case(_traffic, _AUTO + "t.csv --budget-mib nan -o {plans}/auto.json", ""),
    "--max-graphs 0": Case(_traffic, _AUTO + "t.csv --max-graphs 0 -o {plans}/auto.json", ""),
    "--max-padding -1": Case(_traffic, _AUTO + "t.csv --max-padding -1 -o {plans}/auto.json", ""),
    "--context 0": Case(_traffic, _AUTO + "t.csv --context 0 -o {plans}/auto.json", ""),
    "--traffic without --sizes auto": Case(
        _traffic, "planner build -b fa3 --traffic {up}t.csv --max-graphs 8 -o {plans}/auto.json", ""
    ),
}


@pytest.mark.parametrize("where", ["root", "elsewhere"])
@pytest.mark.parametrize("name", list(CASES))
def test_the_fix_an_error_names_works_from_where_the_user_stands(tmp_path, name, where):
    case = CASES[name]
    repo = tmp_path / "repo"
    repo.mkdir()
    case.setup(repo)
    cwd = repo if where == "root" else repo / "elsewhere"
    cwd.mkdir(exist_ok=True)
    up = "" if where == "root" else "../"
    command = case.command.format(
        plans=f"{up}plans", spec=f"{up}x.toml", bad=f"{up}bad.toml", empty=f"{up}empty.toml", up=up
    )
    failed = sh(command, cwd)
    assert failed.returncode == 1, (command, failed.stdout, failed.stderr)
    lines = [line for line in failed.stderr.splitlines() if line.startswith("planner: error: ")]
    assert lines and all(fixes(line + "\n") for line in lines), f"{command}: a line names no command: {lines}"
    before = {p: p.read_bytes() for p in repo.rglob("*") if p.is_file()}
    for line in lines:
        # a line about one file (several plans stale: one line each) fixes that file; the others fix it all
        where_ = line.removeprefix("planner: error: ").partition(": ")[0]
        one = (cwd / where_).is_file() and len(lines) > 1
        for fix in fixes(line + "\n"):
            for p in list(repo.rglob("*")):  # each fix from the state the error was about
                if p.is_file() and p not in before:
                    p.unlink()
            for p, data in before.items():
                p.write_bytes(data)
            done = sh(fix, cwd)
            assert done.returncode == 0, (command, fix, done.stdout, done.stderr)
            assert not list(repo.rglob("plans/plans")), fix  # a recorded command run in the wrong folder
            if case.then == "":
                continue  # the fix (checking the plan itself) passing is the point
            again = sh(case.then or command, cwd)
            if one:
                assert f"planner: error: {where_}:" not in again.stderr, (command, fix, again.stderr)
            else:
                assert again.returncode == 0, (command, fix, again.stdout, again.stderr)


# -- every error the CLI raises carries a fix (issue 40, item 7) ----------------------------------

#: the error classes: schemas/errors.py's and their subclasses in the planner
_ERRORS = {"CapturePlanError", "InputError", "WrongKindError", "RecordMoreError", "ConstraintError", "DriftError"}


def _error_calls():
    """Every construction of a CapturePlanError class in the code the CLI runs (planner/,
    schemas/): (file:line, whether it passes a fix that is not None)."""
    import ast

    trees = {p: ast.parse(p.read_text()) for folder in ("planner", "schemas") for p in (ROOT / folder).rglob("*.py")}
    classes = set(_ERRORS)
    for tree in trees.values():
        for n in ast.walk(tree):
            if isinstance(n, ast.ClassDef) and any(getattr(b, "id", None) in classes for b in n.bases):
                classes.add(n.name)
    for path, tree in sorted(trees.items()):
        for n in ast.walk(tree):
            if isinstance(n, ast.Call) and getattr(n.func, "id", getattr(n.func, "attr", None)) in classes:
                # planner/fit/refusal.py's Refusal makes its fix of its hint and its change
                fix = next((k.value for k in n.keywords if k.arg in ("fix", "hint")), None)
                given = fix is not None and not (isinstance(fix, ast.Constant) and fix.value is None)
                yield f"{path.relative_to(ROOT)}:{n.lineno}", given or n.func.__dict__.get("id") == "StalePlans"


def test_every_error_the_planner_constructs_names_a_fix():
    """Was: `heads must be a multiple of kv_heads`, malformed TOML, an unknown --phase, a bad
    pin, a damaged trace or snapshot, ... one line with no fix, though the README promises one."""
    calls = list(_error_calls())
    assert len(calls) > 200  # the scan sees the code
    assert [where for where, given in calls if not given] == []


@pytest.mark.parametrize(
    "spec, says",
    [
        (SPEC + '[model]\npreset = "llama-3-8b"\nkv_heads = 5\n', "heads must be a multiple of kv_heads"),
        ('version = 1\nname = "x\n', "malformed TOML"),
        (SPEC + '[[rules]]\nid = "a"\nwhy = "w"\n[[rules]]\nid = "a"\nwhy = "w"\n', "duplicate rule id"),
        (SPEC.replace("sizes", 'after = ["decode"]\nsizes'), "a phase cannot come after itself"),
    ],
)
def test_the_errors_the_issue_found_without_a_fix_have_one(tmp_path, spec, says):
    (tmp_path / "s.toml").write_text(spec)
    failed = sh("planner build -b fa3 --spec s.toml --dry-run", tmp_path)
    assert failed.returncode == 1 and says in failed.stderr, failed.stderr
    assert "; fix: " in failed.stderr and "fix: None" not in failed.stderr, failed.stderr


@pytest.mark.parametrize(
    "command",
    [
        "planner build -b fa3 --spec missing.toml --dry-run",
        "planner build -b fa3 --spec j.json --dry-run",
        "planner build -b fa3 -s nope --dry-run",
        "planner build -b fa3 -s verify.order=smallest-first --dry-run",
        "planner sizes -b fa3 --traffic t.csv --phase nope",
        "planner sizes -b fa3 --traffic t.csv --budget-mib 0",
        "planner report missing.json",
        "planner show missing.json",
    ],
)
def test_no_error_line_is_without_a_fix_or_says_fix_none(tmp_path, command):
    (tmp_path / "j.json").write_text('{"a": ')
    (tmp_path / "t.csv").write_text("size,count\n1,5\n")
    failed = sh(command, tmp_path)
    assert failed.returncode == 1 and failed.stderr.startswith("planner: error: "), failed.stderr
    assert "; fix: " in failed.stderr and "fix: None" not in failed.stderr, failed.stderr
