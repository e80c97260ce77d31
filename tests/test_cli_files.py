"""Paths the CLI reads and writes: names too long or not UTF-8, NUL bytes, symlinks and
loops, linked folders, FIFOs, devices, sizes, file modes, temp files.

Every bad path is one located line and exit 1, and nothing is written. The
output-path tests failed before their fix (issue 18, faults 1 and 4):
``Path.exists()`` raised on a name too long (exit 3, "internal error: OSError:
[Errno 36]"), a folder at ``-o`` was "pass --force to replace it" and then refused
by --force, and a file where a folder should be was "File exists"."""

from __future__ import annotations

import errno
import os
import stat
import threading
from pathlib import Path

import pytest

from capture_plan.schemas.errors import InputError
from cli_inputs import SPEC, one_line_error

LONG = "a" * 300 + ".json"


def _one_line(result, text: str) -> None:
    code, out, err = result
    assert (code, out) == (1, ""), (code, out, err)
    assert err == f"planner: error: {text}\n"


def test_a_name_too_long_is_cannot_write(cli):
    _one_line(
        cli("build", "-b", "fa3", "-o", LONG), f"{LONG}: cannot write: file name too long; fix: use a shorter path"
    )


def test_a_name_too_long_with_check_is_cannot_check(cli):
    _one_line(
        cli("build", "-b", "fa3", "-o", LONG, "--check"),
        f"{LONG}: cannot check: file name too long; fix: use a shorter path",
    )


@pytest.mark.parametrize("check", [False, True])
def test_a_folder_that_may_not_be_searched(cli, tmp_path, monkeypatch, check):
    # as a non-root user, stat() of a path under a folder without x permission is EACCES;
    # the tests may run as root, so the refusal is simulated where the planner looks
    real = os.stat
    target = os.path.join("locked", "p.json")

    def stat(path, *a, **kw):
        if os.fspath(path) == target:
            raise PermissionError(errno.EACCES, "Permission denied", target)
        return real(path, *a, **kw)

    monkeypatch.setattr(os, "stat", stat)
    args = ("build", "-b", "fa3", "-o", target) + (("--check",) if check else ())
    doing = "check" if check else "write"
    _one_line(cli(*args), f"{target}: cannot {doing}: Permission denied; fix: choose a writable path")


@pytest.mark.parametrize("force", [False, True])
def test_a_folder_at_the_output_is_refused_as_a_folder(cli, tmp_path, force):
    (tmp_path / "adir").mkdir()
    _one_line(
        cli("build", "-b", "fa3", "-o", "adir", *(["--force"] if force else [])),
        "adir: cannot write: is a directory; fix: name a plan file with -o, not a folder",
    )
    assert (tmp_path / "adir").is_dir() and os.listdir(tmp_path / "adir") == []


@pytest.mark.parametrize("args,doing", [((), "write"), (("--check",), "check")])
def test_a_file_where_a_folder_should_be(cli, tmp_path, args, doing):
    (tmp_path / "afile").write_text("x")
    _one_line(
        cli("build", "-b", "fa3", "-o", "afile/plan.json", *args),
        f"afile/plan.json: cannot {doing}: afile is a file, not a folder; fix: rename afile, or choose another path",
    )
    assert (tmp_path / "afile").read_text() == "x"


def test_plot_under_a_file_is_refused_before_printing(cli, tmp_path):
    assert cli("build", "-b", "fa3")[0] == 0
    (tmp_path / "afile").write_text("x")
    _one_line(
        cli("simulate", "plans/fa3.json", "--plot", "afile/t.png"),
        "--plot afile/t.png: cannot write: afile is a file, not a folder; fix: rename afile, or choose another path",
    )


def test_unknown_backend_unreadable_spec_and_unwritable_output(cli, tmp_path):
    code, _, err = cli("build", "-b", "xformers")
    assert code == 1 and "--backend: unknown backend 'xformers'; fix: use one of fa3, flashinfer, torch, triton" in err
    code, _, err = cli("build", "-b", "fa3", "--spec", "missing.toml")
    assert code == 1 and "missing.toml: cannot read spec: No such file or directory" in err
    (tmp_path / "ro").mkdir()
    (tmp_path / "ro").chmod(0o500)
    try:
        code, _, err = cli("build", "-b", "fa3", "-o", "ro/plan.json")
        if os.geteuid() != 0:  # root can write anywhere
            assert code == 1 and "ro/plan.json: cannot write: Permission denied" in err
            assert os.listdir(tmp_path / "ro") == []
    finally:
        (tmp_path / "ro").chmod(0o700)
    (tmp_path / "file").write_text("x")
    code, _, err = cli("build", "-b", "fa3", "-o", "file/plan.json")
    assert code == 1 and "file/plan.json: cannot write" in err


def test_check_through_a_linked_plans_folder(cli, tmp_path, monkeypatch):
    # before: the plan records --spec ../specs/s.toml (lexically, relative to plans/), but check
    # opened plans/../specs/s.toml, which the OS resolves from the link's target: "cannot read spec"
    (tmp_path / "repo/specs").mkdir(parents=True)
    (tmp_path / "shared/plans").mkdir(parents=True)
    (tmp_path / "repo/plans").symlink_to("../shared/plans")
    (tmp_path / "repo/specs/s.toml").write_text(SPEC)
    monkeypatch.chdir(tmp_path / "repo")
    assert cli("build", "-b", "fa3", "--spec", "specs/s.toml")[0] == 0
    code, out, err = cli("check", "plans")
    assert code == 0 and out == "plans/fa3-s.json: up to date\n", err
    assert cli("check", "--fix", "plans")[0] == 0


@pytest.mark.parametrize("flag", ["--spec", "-o"])
def test_a_non_utf8_file_name_is_a_located_error(cli, tmp_path, flag):
    # before: internal error (exit 3), UnicodeEncodeError writing the plan's JSON
    import os

    if os.uname().sysname == "Darwin":
        pytest.skip("macOS file systems refuse such names")
    name = os.fsdecode(b"s\xff.toml")
    (tmp_path / name).write_text(SPEC)
    args = ("--spec", name) if flag == "--spec" else ("-o", os.fsdecode(b"o\xff.json"))
    one_line_error(cli("build", "-b", "fa3", *args), f"{flag} ", "path is not valid UTF-8", "fix: rename the file")
    assert sorted(os.listdir(tmp_path)) == [name]


@pytest.mark.parametrize("args", [("build", "-b", "fa3", "-o", "out/"), ("simulate", "P", "--plot", "out/")])
def test_an_output_path_ending_in_a_slash_is_refused_not_written_as_a_file(cli, tmp_path, args):
    # before: click turned "out/" into Path("out"): build wrote a plan file named `out`
    if args[0] == "simulate":
        assert cli("build", "-b", "fa3", "-o", "p.json")[0] == 0
        args = tuple("p.json" if a == "P" else a for a in args)
    one_line_error(cli(*args), "'out/' names a folder, not a file", "fix: give a file name, e.g. out/what-if.json")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "args,example",
    [
        (("build", "-b", "fa3", "-o", "out/."), "out/what-if.json"),
        (("build", "-b", "fa3", "-o", "out/.."), "./what-if.json"),
        (("simulate", "P", "--plot", "out/."), "out/what-if.json"),
    ],
)
def test_an_output_path_ending_in_dot_names_a_folder_too(cli, tmp_path, args, example):
    # before: click's Path made "out/." Path("out"): build wrote a plan file named `out`, and
    # `--plot out/.` a PNG named `out`; "out/.." created the folder `out`, then failed
    if args[0] == "simulate":
        assert cli("build", "-b", "fa3", "-o", "p.json")[0] == 0
        args = tuple("p.json" if a == "P" else a for a in args)
    (tmp_path / "keep").mkdir()  # something in the folder: a stray write would show
    before = sorted(p.name for p in tmp_path.iterdir())
    one_line_error(cli(*args), f"{args[-1]!r} names a folder, not a file", f"fix: give a file name, e.g. {example}")
    assert sorted(p.name for p in tmp_path.iterdir()) == before


@pytest.mark.parametrize("make", ["dir", "fifo"])
def test_simulate_plot_to_a_folder_or_fifo_is_refused_before_the_timeline_is_printed(cli, tmp_path, make):
    # before: the timeline went to stdout, then write_atomic refused the path (exit 1 after
    # output: a refused --plot is meant to be one line on stderr and nothing on stdout)
    import os

    assert cli("build", "-b", "fa3", "-o", "p.json")[0] == 0
    os.mkdir(tmp_path / "t.png") if make == "dir" else os.mkfifo(tmp_path / "t.png")
    code, out, err = cli("simulate", "p.json", "--plot", "t.png")
    one_line_error((code, out, err), "--plot t.png: cannot write: is a ", "fix: plot to a new .png path")
    assert out == ""


def test_a_nul_byte_in_a_path_is_refused(cli, tmp_path):
    (tmp_path / "s.toml").write_text('trace = "t\\u0000.json"\n' + SPEC)
    one_line_error(cli("build", "-b", "fa3", "--spec", "s.toml"), "s.toml: $.trace", "NUL")
    with pytest.raises(InputError, match="NUL"):
        from capture_plan.schemas.files import read_input

        read_input("a\0b", "plan")
    with pytest.raises(InputError, match="NUL"):
        from capture_plan.schemas.files import write_atomic

        write_atomic(Path("a\0b"), b"x")


def test_a_symlink_loop_as_output_plan_or_trace_is_named(cli, tmp_path):
    os.symlink("b.json", tmp_path / "a.json")
    os.symlink("a.json", tmp_path / "b.json")
    one_line_error(cli("build", "-b", "fa3", "-o", "a.json"), "a.json", "symlink loop")
    one_line_error(cli("show", "a.json"), "a.json", "symlink loop")
    (tmp_path / "s.toml").write_text(SPEC)
    one_line_error(cli("build", "-b", "fa3", "--spec", "s.toml", "--trace", "a.json"), "symlink loop")


def test_output_through_a_symlink_writes_its_target(cli, tmp_path):
    (tmp_path / "real").mkdir()
    os.symlink("real/p.json", tmp_path / "link.json")  # dangling until written
    assert cli("build", "-b", "fa3", "-o", "link.json")[0] == 0
    assert (tmp_path / "link.json").is_symlink() and (tmp_path / "real/p.json").is_file()


@pytest.mark.parametrize("device", ["/dev/zero", "/dev/urandom", "/dev/null"])
def test_device_files_are_not_a_spec_plan_or_report(cli, device):
    one_line_error(cli("build", "-b", "fa3", "--spec", device), device, "not a spec file")
    one_line_error(cli("show", device), device, "not a plan file")
    one_line_error(cli("report", device), device, "not a report file")


def test_a_fifo_without_a_writer_does_not_hang(cli, tmp_path):
    os.mkfifo(tmp_path / "f.json")
    result: list = []
    t = threading.Thread(target=lambda: result.append(cli("show", "f.json")), daemon=True)
    t.start()
    t.join(20)
    assert not t.is_alive(), "planner show on a FIFO hangs"
    one_line_error(result[0], "f.json: is a FIFO")


def test_directories_missing_and_huge_files_are_one_line(cli, tmp_path):
    from capture_plan.schemas.limits import FILE_LIMITS

    (tmp_path / "d.toml").mkdir()
    one_line_error(cli("build", "-b", "fa3", "--spec", "d.toml"), "d.toml: is a directory")
    one_line_error(cli("show", "missing.json"), "missing.json: cannot read plan: No such file")
    with open(tmp_path / "big.toml", "wb") as f:  # sparse: no disk used
        f.truncate(FILE_LIMITS["spec"] + 1)
    one_line_error(cli("build", "-b", "fa3", "--spec", "big.toml"), "over the limit")
    (tmp_path / "s.toml").write_text(SPEC)
    one_line_error(
        cli("build", "-b", "fa3", "--spec", "s.toml", "--trace", "nope.json"),
        "nope.json: cannot read trace",
        "capture_plan.executor.profile",
    )


def test_file_modes_long_names_and_no_temp_files_left(cli, tmp_path):
    from capture_plan.schemas.files import write_atomic

    old = os.umask(0o022)
    try:
        write_atomic(tmp_path / "a.json", b"1")
        assert stat.S_IMODE(os.stat(tmp_path / "a.json").st_mode) == 0o644
        os.chmod(tmp_path / "a.json", 0o640)
        write_atomic(tmp_path / "a.json", b"2")
        assert stat.S_IMODE(os.stat(tmp_path / "a.json").st_mode) == 0o640  # an existing file keeps its mode
        os.umask(0o077)
        write_atomic(tmp_path / "b.json", b"1")
        assert stat.S_IMODE(os.stat(tmp_path / "b.json").st_mode) == 0o600
    finally:
        os.umask(old)
    long = "p" * 245 + ".json"  # 250 characters: legal
    assert cli("build", "-b", "fa3", "-o", long)[0] == 0 and (tmp_path / long).is_file()
    # a writer killed between write and rename: its temp file goes with the next write
    from capture_plan.schemas.files import _tmp_prefix

    dead = tmp_path / f"{_tmp_prefix(tmp_path / 'a.json')}999999999-abcd.tmp"
    live = tmp_path / f"{_tmp_prefix(tmp_path / 'a.json')}{os.getpid()}-abcd.tmp"
    dead.write_bytes(b"x")
    live.write_bytes(b"x")
    write_atomic(tmp_path / "a.json", b"3")
    assert not dead.exists() and live.exists()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")) == [live.name]
