"""Reading inputs safely and writing outputs atomically, shared by planner and executor.

Reading: only regular files, at most ``limits.FILE_LIMITS[kind]`` bytes; a
FIFO, a device (``/dev/zero``), a directory, a missing file, a symlink loop or a
path with a NUL byte is one located :class:`InputError`, decided before a byte
is read (a FIFO is opened non-blocking, so a FIFO with no writer never hangs).

Writing: a temporary file beside the target, then ``os.replace``: readers see
the old file or the new one, never half of one; concurrent writers leave one
valid file. The new file gets the target's existing mode, or 0666 minus the
umask like any other created file. Temporary names are short (a legal
255-byte target name still works) and carry the writer's pid, so a temp file
left by a writer killed between write and rename is removed by the next write
to the same target. What this does NOT do: fsync (a power loss may lose the
new contents, never corrupt the old), or lock against concurrent writers (the
last rename wins).
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from .errors import InputError
from .hashing import sha1_hex
from .limits import FILE_LIMITS

__all__ = ["write_atomic", "read_input", "existing_output"]

_KIND_NAMES = {
    stat.S_IFDIR: "a directory",
    stat.S_IFIFO: "a FIFO (named pipe)",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
}


def _oserror(err: OSError, doing: str, where: str, fix: str | None) -> InputError:
    # every error carries a fix (the CLI promises one): the caller's, else the path to check
    fix = fix or "check the path, and that the file is there and may be read"
    if err.errno == errno.ELOOP:
        return InputError(f"cannot {doing}: symlink loop", where=where, fix="point the path at a real file")
    if err.errno == errno.ENAMETOOLONG:
        return InputError(f"cannot {doing}: file name too long", where=where, fix="use a shorter path")
    return InputError(f"cannot {doing}: {err.strerror or err}", where=where, fix=fix)


def read_input(path: str | Path, kind: str, *, fix: str | None = None, stream: bool = False) -> bytes:
    """The bytes of the ``kind`` file (spec, plan, trace, report) at ``path``.

    Refuses non-regular files and files over the kind's size limit before
    reading; every failure is an :class:`InputError` naming the path. With
    ``stream``, a pipe is read too, and ``-`` is standard input (``planner diff
    <(git show HEAD:plans/x.json) plans/x.json``, ``git show ... | planner diff -
    plans/x.json``): read to its end, within the same limit (a FIFO nobody writes
    reads as empty, no hang).
    """
    where = str(path)
    limit = FILE_LIMITS[kind]
    if stream and where == "-":
        import sys

        data = sys.stdin.buffer.read(limit + 1)
        if len(data) > limit:
            raise InputError(
                f"{kind} on standard input is over the limit of {limit:,} bytes",
                where="-",
                fix=f"a {kind} this large is not a real one; check what is piped in",
            )
        return data
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except ValueError:  # embedded NUL byte
        raise InputError(f"{kind} path contains a NUL byte", where=repr(where), fix="check the path") from None
    except OSError as err:
        if err.errno == errno.EISDIR:
            raise InputError(f"is a directory, not a {kind} file", where=where, fix=f"pass a {kind} file") from None
        raise _oserror(err, f"read {kind}", where, fix) from None
    try:
        st = os.fstat(fd)
        if stream and stat.S_ISFIFO(st.st_mode):  # opened without blocking (no writer: no hang); read blocking
            import fcntl

            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~getattr(os, "O_NONBLOCK", 0))
        elif not stat.S_ISREG(st.st_mode):
            what = _KIND_NAMES.get(stat.S_IFMT(st.st_mode), "not a regular file")
            raise InputError(f"is {what}, not a {kind} file", where=where, fix=f"pass a regular {kind} file")
        if st.st_size > limit:
            raise InputError(
                f"{kind} file is {st.st_size:,} bytes, over the limit of {limit:,}",
                where=where,
                fix=f"a {kind} this large is not a real one; check the path",
            )
        chunks, total = [], 0
        while True:  # read past st_size: the file may grow, never past the limit
            try:
                chunk = os.read(fd, min(1 << 20, limit + 1 - total))
            except OSError as err:
                raise _oserror(err, f"read {kind}", where, fix) from None
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            if total > limit:
                raise InputError(
                    f"{kind} file is over the limit of {limit:,} bytes",
                    where=where,
                    fix=f"a {kind} this large is not a real one; check the path",
                )
        return b"".join(chunks)
    finally:
        os.close(fd)


def _target(path: Path) -> Path:
    """``path``, or where it points when it is a symlink (writes go through links)."""
    try:
        if not path.is_symlink():
            return path
        try:
            return Path(os.path.realpath(path, strict=True))
        except FileNotFoundError:  # a dangling link: create what it names
            return path.parent / os.readlink(path)
    except ValueError:
        raise InputError("output path contains a NUL byte", where=repr(str(path)), fix="check the path") from None
    except OSError as err:
        raise _oserror(err, "write", str(path), "point the output at a real file") from None


def _tmp_prefix(path: Path) -> str:
    return ".cp-" + sha1_hex(path.name.encode("utf-8", "surrogateescape"))[:12] + "-"


def _sweep(path: Path) -> None:
    """Remove temp files of ``path`` left by writers that no longer run."""
    prefix = _tmp_prefix(path)
    try:
        names = [n for n in os.listdir(path.parent or ".") if n.startswith(prefix) and n.endswith(".tmp")]
    except OSError:
        return
    for name in names:
        try:
            pid = int(name[len(prefix) :].split("-")[0])
            if pid <= 0:
                continue
            os.kill(pid, 0)
            continue  # its writer still runs
        except ProcessLookupError:
            pass
        except (ValueError, PermissionError, OSError):
            continue  # not ours, or a live process of another user
        try:
            os.unlink(path.parent / name)
        except OSError:
            pass


def _file_on_the_way(path: Path) -> Path | None:
    """The nearest folder of ``path`` that exists and is no folder (``afile`` of
    ``afile/plan.json``), None when there is none."""
    for parent in path.parents:
        try:
            if parent.exists() and not parent.is_dir():
                return parent
        except (OSError, ValueError):
            pass
    return None


def existing_output(
    path: str | Path, where: str, fix: str, doing: str = "write", *, special_fix: str | None = None
) -> os.stat_result | None:
    """The stat of the file an output would replace, None when there is none;
    an :class:`InputError` (``where``, ``fix``) when it is a directory, FIFO,
    device or socket, which an output never replaces, and ``cannot <doing>: ...``
    when the path cannot even be looked at: a name too long for the file
    system, a folder the user may not search, a folder on the path that is a
    regular file (``afile/plan.json``). ``Path.exists()`` raises on the first
    two (it only swallows "no such file"), which is why callers ask here. ``special_fix``,
    where given, is the fix for a FIFO, device or socket instead of ``fix`` (``-o /dev/null``)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    except NotADirectoryError:
        blocker = _file_on_the_way(Path(path))
        named, rename = (str(blocker), str(blocker)) if blocker is not None else ("a folder on the path", "that file")
        raise InputError(
            f"cannot {doing}: {named} is a file, not a folder",
            where=where,
            fix=f"rename {rename}, or choose another path",
        ) from None
    except ValueError:
        raise InputError("output path contains a NUL byte", where=repr(str(path)), fix="check the path") from None
    except OSError as err:
        raise _oserror(err, doing, where, "choose a writable path") from None
    if not stat.S_ISREG(st.st_mode):
        what = _KIND_NAMES.get(stat.S_IFMT(st.st_mode), "not a regular file")
        if special_fix is not None and not stat.S_ISDIR(st.st_mode):
            fix = special_fix
        raise InputError(f"cannot {doing}: is {what}", where=where, fix=fix)
    return st


def write_atomic(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temp file and a rename: never half-written."""
    where = str(path)
    path = _target(Path(path))
    fix = "choose a writable path"
    try:
        st = existing_output(path, where, "name a regular file for the output")
        path.parent.mkdir(parents=True, exist_ok=True)
        mode = None if st is None else stat.S_IMODE(st.st_mode)
        _sweep(path)
        tmp = path.parent / f"{_tmp_prefix(path)}{os.getpid()}-{os.urandom(4).hex()}.tmp"
        # 0o666: the umask applies, as for any newly created file
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
    except ValueError:
        raise InputError("output path contains a NUL byte", where=repr(where), fix="check the path") from None
    except OSError as err:
        raise _oserror(err, "write", where, fix) from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if mode is not None:
                os.fchmod(f.fileno(), mode)  # replacing a file keeps its mode
        os.replace(tmp, path)
    except OSError as err:
        _unlink(tmp)
        raise _oserror(err, "write", where, fix) from None
    except BaseException:
        _unlink(tmp)
        raise


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
