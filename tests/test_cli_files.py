"""Output paths that cannot be looked at or written (issue 18, faults 1 and 4).

Each test failed before its fix: ``Path.exists()`` raised on a name too long
(exit 3, "internal error: OSError: [Errno 36]"), a folder at ``-o`` was
"pass --force to replace it" and then refused by --force, and a file where
a folder should be was "File exists".
"""

from __future__ import annotations

import errno
import os

import pytest

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
