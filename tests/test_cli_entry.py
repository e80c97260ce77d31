"""The ``planner`` entry point: usage errors (exit 2), help, version, --debug, internal
errors (exit 3), Ctrl-C (130), a closed stdout pipe (141), the console script."""

from __future__ import annotations

import pytest


def _no_such_option(err: str, name: str) -> bool:
    # click words it "No such option: --x" (8.2) or "No such option '--x'" (8.3): both name it
    return "No such option" in err and name in err


def test_usage_errors_are_the_frameworks_exit_2(cli):
    code, _, err = cli("build")
    assert code == 2 and "Missing option '--backend'" in err and "Try 'planner build -" in err
    code, _, err = cli("build", "-b", "fa3", "--frobnicate")
    assert code == 2 and _no_such_option(err, "--frobnicate")
    code, _, err = cli("biuld")
    assert code == 2 and "No such command 'biuld'" in err and "planner planner" not in err
    code, _, err = cli("build", "-b", "fa3", "--tp", "x")
    assert code == 2 and "Invalid value for '--tp'" in err
    code, _, err = cli("show")
    assert code == 2 and "Missing argument 'plan'." in err  # the name, not the usage line's {plan}


def test_bare_planner_help_version_and_debug(cli):
    code, out, err = cli()
    assert code == 2 and "Usage: planner" in out + err and "Commands" in out + err
    assert len((out + err).splitlines()) > 5  # the help as the framework lays it out, not squashed
    for flag in ("-h", "--help"):
        code, out, _ = cli(flag)
        assert code == 0 and out.startswith("Usage: planner")
    code, out, _ = cli("--version")
    from capture_plan import executor, planner, schemas
    from capture_plan.planner.memory.core import core

    assert code == 0 and out == f"planner (capture-plan) {schemas.__version__}\nallocator core: {core().describe()}\n"
    assert planner.__version__ == executor.__version__ == schemas.__version__
    from importlib.metadata import version

    assert version("capture-plan") == schemas.__version__  # pyproject reads the same attribute
    # --debug belongs to `planner`, before the command; after it, it is unknown (no argv scanning)
    code, _, err = cli("build", "-b", "nope", "--debug")
    assert code == 2 and _no_such_option(err, "--debug")
    code, _, err = cli("build", "-b", "nope")
    assert code == 1 and err.count("\n") == 1
    from capture_plan.schemas.errors import InputError

    with pytest.raises(InputError):  # --debug: the traceback of any error
        cli("--debug", "build", "-b", "nope")


def test_help_lists_arguments_and_shell_completion_offers_commands_backends_and_pins(cli, monkeypatch):
    code, out, _ = cli("show", "-h")
    assert code == 0 and out.startswith("Usage: planner show [OPTIONS] {plan}")
    assert "Arguments:\n  plan <path>  Plan file.  [required]" in out
    code, out, _ = cli("build", "-h")
    assert code == 0 and "Attention backend: fa3, flashinfer, torch, triton" in " ".join(out.split())
    monkeypatch.setenv("_PLANNER_COMPLETE", "bash_complete")
    for words, cword, expected in (
        ("planner build --backend f", "3", ["plain,fa3", "plain,flashinfer"]),
        ("planner sh", "1", ["plain,show"]),
        ("planner build -s ord", "3", ["plain,order=largest-first", "plain,order=smallest-first"]),
        ("planner build -s decode.outputs=", "3", ["plain,decode.outputs=keep", "plain,decode.outputs=view"]),
        ("planner build --speculative ''", "3", ["plain,eagle"]),
        ("planner build --preset v", "3", ["plain,vllm"]),
        ("planner build --allocator e", "3", ["plain,expandable"]),
    ):
        monkeypatch.setenv("COMP_WORDS", words)
        monkeypatch.setenv("COMP_CWORD", cword)
        code, out, _ = cli()
        assert (code, out.split()) == (0, expected)


def test_internal_errors_exit_3_and_debug_shows_the_traceback(cli, monkeypatch):
    import capture_plan.planner.build as build

    def boom(opts):
        raise KeyError("oops")

    monkeypatch.setattr(build, "build_plan", boom)
    code, _, err = cli("build", "-b", "fa3")
    assert code == 3 and err.startswith("planner: internal error: KeyError: 'oops' (rerun as `planner --debug")
    with pytest.raises(KeyError):
        cli("--debug", "build", "-b", "fa3")


def test_the_console_script_runs(tmp_path):
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-m", "capture_plan.planner", "build", "-b", "fa3", "--dry-run"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0 and "dry run" in r.stdout
    r = subprocess.run(
        [sys.executable, "-m", "capture_plan.planner", "show", "nope.json"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 1 and r.stderr.count("\n") == 1


def test_ctrl_c_exits_130_and_leaves_the_plan_whole(cli, tmp_path, monkeypatch):
    # before: click's "Aborted!" and exit 1, the code for bad input or drift
    import os

    import capture_plan.schemas.files as files

    assert cli("build", "-b", "fa3")[0] == 0
    plan = (tmp_path / "plans/fa3.json").read_bytes()

    def interrupted(src, dst):
        raise KeyboardInterrupt

    monkeypatch.setattr(files.os, "replace", interrupted)
    code, out, err = cli("build", "-b", "fa3", "-s", "order=smallest-first", "--force")
    assert code == 130 and err == "planner: interrupted\n" and out == "", (code, err)
    assert (tmp_path / "plans/fa3.json").read_bytes() == plan
    assert os.listdir(tmp_path / "plans") == ["fa3.json"]  # no temp file left


def _into_closed_pipe(cwd, *args: str):
    """``planner ARGS`` run with its stdout a pipe whose reader is gone before the first line is
    written (``planner show PLAN | head -0`` under ``set -o pipefail``)."""
    import os
    import subprocess
    import sys

    read, write = os.pipe()
    os.close(read)
    try:
        return subprocess.run(
            [sys.executable, "-m", "capture_plan.planner", *args],
            stdout=write,
            stderr=subprocess.PIPE,
            cwd=cwd,
            timeout=60,
        )
    finally:
        os.close(write)


def test_a_closed_stdout_pipe_exits_141_quietly_not_1(tmp_path):
    # before: click's EPIPE handling, exit 1: the code for bad input or drift, so a CI script
    # with `set -o pipefail` told the user to rebuild plans
    from pathlib import Path

    plan = Path(__file__).resolve().parent.parent / "plans" / "fa3-ci.json"
    r = _into_closed_pipe(tmp_path, "show", str(plan))
    assert r.returncode == 141, (r.returncode, r.stderr)
    assert r.stderr == b"", r.stderr


@pytest.mark.parametrize("args", [("--help",), ("-h",), ("--version",), ("build", "--help")])
def test_help_and_version_into_a_closed_pipe_exit_141_too(tmp_path, args):
    # before: the top-level --help and --version print while click parses the group's
    # options, before the command runs, so click's EPIPE handling gave exit 1 there
    r = _into_closed_pipe(tmp_path, *args)
    assert (r.returncode, r.stderr) == (141, b"")
