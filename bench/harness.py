"""What the benchmarks share: the header and the writing of a result JSON, the engines'
capture loop, the transformers architectures they build, and their common arguments.

Importing this module imports neither torch nor transformers: the GPU pieces import
them when called, so that a bench parses its arguments (``--help``) on a machine
without a GPU, and so that ``bench.allocator_diff`` can set the allocator mode before
torch loads.

Result files follow one convention, ``bench/results/<name>-<date>[-<tag>...].json``
(:func:`result_path`), written as sorted, 2-space-indented JSON (:func:`dumps`). A
:class:`ResultFile` refuses, before anything is measured, a path that already holds a
file it did not write itself, unless told to replace it (``--overwrite``); it does not
lock the path, so two runs started at the same moment can still race.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import gc
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from capture_plan.planner.inputs.specs import sgl_sizes
from capture_plan.schemas.errors import CapturePlanError, InputError

#: the repository's root (bench/ is a folder of it; the benches run from here)
REPO = Path(__file__).resolve().parent.parent
#: where results go unless --out says otherwise
RESULTS = REPO / "bench" / "results"
MiB = 2**20
#: the fields :func:`header` adds for a GPU run
DEVICE_FIELDS = ("device", "driver", "torch", "cuda")
#: environment variables that change what a device run measures (module loading decides when
#: kernel code takes device memory; the allocator's configuration, the pool's segments; cuBLAS's,
#: its workspace): :func:`header` records those set as ``cuda_env``
CUDA_ENV = ("CUDA_MODULE_LOADING", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "CUBLAS_WORKSPACE_CONFIG")


# -- the header every result carries ---------------------------------------------------


def now() -> str:
    """The current UTC time, ISO 8601 to the second (``2026-12-01T09:20:32+00:00``)."""
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


#: ``<commit>:<tree>`` of the commit a copy of the tree claims to be, for a copy whose own
#: ``.git`` is stale (the lent GPU machine's copy keeps the ``.git`` of its first run);
#: make it with ``python -m bench.harness claim`` where the commit is, pass it to the run
CLAIM_ENV = "CAPTURE_PLAN_COMMIT"


def working_tree(root: Path = REPO) -> str | None:
    """The git tree id of the files at ``root`` as they are: tracked and untracked files
    that are not ignored (what a copy of the working tree holds), written through a
    temporary index so that the checkout's own index is untouched; None without git."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "GIT_INDEX_FILE": str(Path(tmp) / "index")}
        try:
            for cmd in (["add", "-A"], ["write-tree"]):
                r = subprocess.run(["git", "-C", str(root), *cmd], capture_output=True, text=True, timeout=120, env=env)
                if r.returncode:
                    return None
        except (OSError, subprocess.TimeoutExpired):
            return None
    return r.stdout.strip()


def claim(root: Path = REPO) -> str:
    """``<commit>:<tree>`` for :data:`CLAIM_ENV`: HEAD and the working tree's id. Refused
    (:class:`NoCheckout`) where git cannot run or ``root`` is not the top of a git checkout
    with a commit (a copy of the tree without ``.git``: claim where the commit is), and
    (:class:`DirtyTree`) where the working tree is not HEAD's (uncommitted or untracked
    files): a claim names a commit that holds exactly the files measured."""
    where = str(root)
    elsewhere = (
        "run python -m bench.harness claim in the git checkout this tree was copied from "
        f"and export {CLAIM_ENV}=<what it printed> here"
    )
    try:
        r = subprocess.run(
            ["git", "-C", where, "rev-parse", "--show-toplevel", "HEAD", "HEAD^{tree}"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        raise NoCheckout(
            f"git cannot run ({err})", where=where, fix=f"put git on PATH (apt-get install git), or {elsewhere}"
        ) from None
    said = next((line for line in r.stderr.splitlines() if line.strip()), "").removeprefix("fatal: ")
    if r.returncode or len(r.stdout.splitlines()) != 3:
        raise NoCheckout(f"not a git checkout with a commit (git rev-parse: {said})", where=where, fix=elsewhere)
    top, head, head_tree = r.stdout.splitlines()
    if Path(top).resolve() != Path(root).resolve():
        raise NoCheckout(
            f"not the top of a git checkout: it is inside {top}, whose commit does not name this tree",
            where=where,
            fix=elsewhere,
        )
    tree = working_tree(root)
    if tree is None:
        raise NoCheckout(
            "git could not write the working tree's id (git add -A or git write-tree failed)",
            where=where,
            fix=f"git -C {where} add -A --dry-run says why; fix that, then python -m bench.harness claim",
        )
    if tree != head_tree:
        raise DirtyTree(
            "the working tree is not HEAD's (uncommitted or untracked, not ignored, files)",
            where=where,
            fix="git status; commit or remove them, then python -m bench.harness claim",
        )
    return f"{head}:{head_tree}"


def claimed_state(root: Path = REPO) -> tuple[str, bool, str | None] | None:
    """With :data:`CLAIM_ENV` set: ``(claimed commit, dirty, tree id of the files at
    root)``, dirty unless those files make exactly the claimed tree; None without it.
    The tree is written once (``git add -A`` over the whole copy): callers that need
    both the state and the tree take them from here."""
    claimed = os.environ.get(CLAIM_ENV)
    if not claimed:
        return None
    commit, _, want = claimed.partition(":")
    if not commit or not want:
        raise InputError(
            f"{CLAIM_ENV}={claimed!r} is not <commit>:<tree>",
            where=CLAIM_ENV,
            fix="set it to the output of python -m bench.harness claim",
        )
    tree = working_tree(root)
    return commit, tree != want, tree


def git_commit(root: Path = REPO) -> tuple[str | None, bool | None]:
    """``(commit, dirty)`` of the checkout at ``root``: ``(None, None)`` where git or the
    checkout is missing (a copy of the tree without ``.git``). ``dirty``: a tracked file
    differs from the commit (untracked files are not counted).

    With :data:`CLAIM_ENV` set (``<commit>:<tree>``, :func:`claim`), the claimed commit,
    dirty unless the files at ``root`` (untracked ones too) make exactly the claimed tree:
    a copy whose ``.git`` is older than the commit it holds records that commit, clean
    only if nothing differs from it."""
    claimed = claimed_state(root)
    if claimed is not None:
        return claimed[0], claimed[1]
    try:
        sha = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=30)
        if sha.returncode:
            return None, None
        status = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None, None
    return sha.stdout.strip(), (bool(status.stdout.strip()) if status.returncode == 0 else None)


def git_diff_digest(root: Path = REPO) -> str | None:
    """The sha256 of ``git diff HEAD --binary`` at ``root``: the uncommitted changes to
    tracked files a dirty result was measured with (two runs from the same commit and
    the same changes have the same digest); None where git or the checkout is missing."""
    try:
        diff = subprocess.run(
            ["git", "-C", str(root), "diff", "HEAD", "--binary"], capture_output=True, text=False, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return hashlib.sha256(diff.stdout).hexdigest() if diff.returncode == 0 else None


def machine() -> str:
    """This machine's CPU and Python, as the CPU benchmarks record them
    (``x86_64 2 cpus, CPython 3.11.7``)."""
    return f"{platform.machine()} {os.cpu_count()} cpus, {platform.python_implementation()} {platform.python_version()}"


def header(*, device: bool) -> dict[str, Any]:
    """The fields every result JSON starts with: ``date`` (:func:`now`), ``git_commit`` and
    ``git_dirty`` (:func:`git_commit`; null where unknown), ``git_diff_sha256`` (the
    digest of the uncommitted changes, :func:`git_diff_digest`; null where the tree is
    clean; none with :data:`CLAIM_ENV` set, where ``git_tree`` is the git tree id of the
    files measured instead), then with ``device`` the GPU's
    ``device`` name, the NVIDIA ``driver``, ``torch`` and the ``cuda`` torch was built
    with, else the CPU ``machine`` (:func:`machine`); ``cuda_env``, the :data:`CUDA_ENV`
    variables set, only where any is.

    ``device`` imports torch and needs CUDA (the device's name); without it nothing
    here imports torch."""
    claimed = claimed_state(REPO)
    if claimed is None:
        commit, dirty = git_commit(REPO)
        digest = git_diff_digest(REPO) if dirty else None
    else:
        # a copy with a stale .git: its diff against that .git's HEAD says nothing (no digest);
        # the files' own tree id names what was measured
        commit, dirty, _ = claimed
        digest = None
    res: dict[str, Any] = {"date": now(), "git_commit": commit, "git_dirty": dirty, "git_diff_sha256": digest}
    if claimed is not None:
        res["git_tree"] = claimed[2]
    env = {k: os.environ[k] for k in CUDA_ENV if k in os.environ}
    if env:
        res["cuda_env"] = env
    if not device:
        res["machine"] = machine()
        return res
    import torch

    from capture_plan.executor.device import driver_version

    values = (torch.cuda.get_device_name(), driver_version(), torch.__version__, torch.version.cuda)
    res.update(zip(DEVICE_FIELDS, values))
    return res


# -- writing results ---------------------------------------------------------------------


class ResultExists(InputError):
    """A results file is already where this run would write its own."""


class DirtyTree(InputError):
    """A result measured from uncommitted changes, not allowed explicitly."""


class NoCheckout(InputError):
    """No git commit to claim (:func:`claim`): git cannot run, or the tree is not a git checkout's top."""


def committed_results(path: str | Path) -> bool:
    """Whether ``path`` is in the results folder the docs quote (:data:`RESULTS`): only
    there must a result name a clean commit; a run written elsewhere (a scratch folder,
    a test's) records its provenance all the same."""
    return Path(path).resolve().is_relative_to(RESULTS.resolve())


def refuse_dirty(allow_dirty: bool, dest: str | Path, root: Path = REPO) -> None:
    """Raise :class:`DirtyTree` where a result is to be written to ``dest`` in the
    committed results (:func:`committed_results`), the checkout at ``root`` has
    uncommitted changes to tracked files and ``allow_dirty`` is false: a bench calls it
    before measuring, so that a quoted figure names a commit that holds the code it
    measured."""
    if not allow_dirty and committed_results(dest) and git_commit(root)[1]:
        raise DirtyTree(
            "the checkout has uncommitted changes; a result must name the commit it measured",
            where=str(root),
            fix="commit (git commit -a), or pass --allow-dirty to record the diff's digest and say so where quoted",
        )


def result_path(out_dir: str | Path, name: str, date: str, *tags: str) -> Path:
    """``out_dir/<name>-<YYYY-MM-DD>[-<tag>...].json``: the day of ``date`` (an ISO time,
    :func:`now`), then each non-empty tag in order."""
    return Path(out_dir) / f"{name}-{date[:10]}{''.join(f'-{t}' for t in tags if t)}.json"


def dumps(res: Any, default: Callable[[Any], Any] | None = None) -> str:
    """The JSON of a result as the committed files have it: keys sorted, 2-space indent,
    a final newline. ``default``: as ``json.dumps``'s (None: a value JSON cannot hold
    raises)."""
    return json.dumps(res, indent=2, sort_keys=True, default=default) + "\n"


class ResultFile:
    """One run's result file at ``path``, written as often as the run likes (benches that
    save after every part, so that a run cut short keeps what it measured).

    Made before measuring: raises :class:`ResultExists` when ``path`` holds a file and
    ``overwrite`` is false, so that a run never replaces an earlier one unasked; the
    check runs again before each write until the first one succeeded (a file that
    appeared meanwhile is not replaced either). Each write goes to a temporary
    sibling, then replaces ``path``: a reader never sees half a file. A result whose
    header says ``git_dirty`` is written into the committed results only with
    ``allow_dirty`` (:class:`DirtyTree` otherwise; :func:`refuse_dirty` is the check
    before measuring)."""

    def __init__(self, path: str | Path, *, overwrite: bool = False, allow_dirty: bool = False):
        self.path = Path(path)
        self.overwrite = overwrite
        self.allow_dirty = allow_dirty
        self._written = False
        self._check()

    def _check(self) -> None:
        if not (self.overwrite or self._written) and self.path.exists():
            raise ResultExists(
                "a results file is already there",
                where=str(self.path),
                fix="pass another --tag or --out, or --overwrite to replace it",
            )

    def write(self, res: Any = None, *, text: str | None = None, default: Callable[[Any], Any] | None = None) -> Path:
        """Write ``res`` as :func:`dumps` spells it (or ``text`` as given); returns the path."""
        self._check()
        data = res if text is None else _json_or_none(text)
        if isinstance(data, dict) and data.get("git_dirty") and not self.allow_dirty and committed_results(self.path):
            raise DirtyTree(
                "the result was measured from uncommitted changes (git_dirty)",
                where=str(self.path),
                fix="commit and run again, or pass --allow-dirty to write it with the diff's digest",
            )
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(dumps(res, default) if text is None else text)
        tmp.replace(self.path)
        self._written = True
        return self.path


def _json_or_none(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def result_file(args: argparse.Namespace, name: str, date: str, *tags: str) -> ResultFile:
    """The :class:`ResultFile` of a bench whose ``--out`` is a folder (:func:`add_out_dir`)
    and that has ``--overwrite`` and ``--allow-dirty`` (:func:`add_overwrite`), named by
    :func:`result_path`; refuses a dirty checkout first (:func:`refuse_dirty`)."""
    path = result_path(args.out, name, date, *tags)
    refuse_dirty(args.allow_dirty, path)
    return ResultFile(path, overwrite=args.overwrite, allow_dirty=args.allow_dirty)


# -- the command line ---------------------------------------------------------------------


def add_out_dir(ap: argparse.ArgumentParser) -> None:
    """``--out DIR``: the folder of the result JSON, bench/results/ by default."""
    ap.add_argument("--out", default=str(RESULTS), help="folder of the result JSON (default: bench/results/)")


def add_overwrite(ap: argparse.ArgumentParser) -> None:
    """``--overwrite``: replace a results file of the same name (else the run stops first);
    ``--allow-dirty``: measure from uncommitted changes (else the run stops first), the
    result recording ``git_dirty`` and the diff's digest."""
    ap.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a results file of the same name (without it the run stops before measuring)",
    )
    ap.add_argument(
        "--allow-dirty",
        action="store_true",
        help="measure from a checkout with uncommitted changes; the result records git_dirty and the diff's "
        "sha256, and the docs say so where they quote it (without it the run stops before measuring)",
    )


def add_layers(ap: argparse.ArgumentParser, help: str = "layers of the reference model") -> None:
    """``--layers N``: the reference model's layers, 32 (Llama-3-8B's) by default."""
    ap.add_argument("--layers", type=int, default=32, help=f"{help} (default 32)")


def main_exit(main: Callable[[], int | None]) -> None:
    """Run a bench's ``main`` and exit with its status (None: 0); a deliberate error
    (:class:`~capture_plan.schemas.errors.CapturePlanError`, such as :class:`ResultExists`)
    is one line on stderr and its exit code (1), not a traceback."""
    try:
        code = main()
    except CapturePlanError as err:
        print(f"{Path(sys.argv[0]).stem}: {err}", file=sys.stderr)
        sys.exit(err.exit_code)
    sys.exit(code or 0)


# -- timing on the CPU ----------------------------------------------------------------------


def median_time(fn: Callable[[], Any], repeat: int) -> float:
    """The median wall time of ``repeat`` calls of ``fn()``, in seconds."""
    import statistics

    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def child_times(cmd: list[str], **kw) -> tuple[float, float]:
    """Run ``cmd`` (``subprocess.run(cmd, check=True, capture_output=True, **kw)``) and return
    its wall time and the child's CPU time (user + system), in seconds: on a shared machine
    the CPU time moves less with the load than the wall clock."""
    import resource

    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True, **kw)
    wall = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime


def run_module(name: str, args: Iterable[str], **kw) -> subprocess.CompletedProcess:
    """``python -m bench.<name> ARGS`` in a child process, from the repository's root (where
    ``bench`` is importable), with this interpreter; ``kw`` as ``subprocess.run``'s. Paths
    in ``args`` should be absolute: the child's working folder is the root."""
    return subprocess.run([sys.executable, "-m", f"bench.{name}", *args], cwd=REPO, **kw)


# -- the engines' loop ------------------------------------------------------------------------


def outputs(out) -> tuple:
    """A target's ``run`` result as a tuple of tensors (a single tensor becomes one)."""
    return out if isinstance(out, tuple) else (out,)


def largest_first(phases: Iterable[tuple[str, Iterable[int]]], ascending: bool = False) -> list[tuple[str, list[int]]]:
    """``(phase, sizes)`` in the given phase order, each phase's sizes largest-first (the
    engines' order) or, with ``ascending``, smallest-first."""
    return [(phase, sorted(sizes, reverse=not ascending)) for phase, sizes in phases]


@dataclass
class LoopRun:
    """What :func:`engine_loop` captured. Keys are ``(phase, bs)``."""

    #: the graphs, in capture order
    graphs: dict = field(default_factory=dict)
    #: each graph's outputs (a tuple): kept from the capture, or with ``keep_copy`` the
    #: persistent buffers the graph copies them into
    outs: dict = field(default_factory=dict)
    #: the one pool every graph was captured into
    pool: Any = None
    #: seconds per phase, from its first warm-up to the end of its last capture
    phase_seconds: dict = field(default_factory=dict)
    #: seconds of the whole loop (after a device synchronize at both ends)
    seconds: float = 0.0
    #: ``"phase/bs"`` of the out-of-memory error that stopped the loop (``stop_at_oom``)
    oom: str | None = None
    #: free device bytes after each capture (``free_after``)
    free_after: list = field(default_factory=list)
    #: per capture with ``driver_memory``: ``{"bs", "nodes", "warmup_bytes", "record_bytes",
    #: "instantiate_bytes", "replay_bytes"}``, the free memory its warm-ups, its recording, its
    #: instantiation and its first replay took that the allocator did not reserve
    driver: list = field(default_factory=list)


def free_bytes() -> int:
    """Free device memory (``torch.cuda.mem_get_info``) after a synchronize."""
    import torch

    torch.cuda.synchronize()
    return int(torch.cuda.mem_get_info()[0])


def driver_state() -> tuple[int, int]:
    """(free device bytes, torch's reserved bytes) after a synchronize: two of them give
    :func:`outside_bytes`."""
    import torch

    torch.cuda.synchronize()
    return int(torch.cuda.mem_get_info()[0]), int(torch.cuda.memory_reserved())


def outside_bytes(a: tuple[int, int], b: tuple[int, int]) -> int:
    """Free memory taken between states ``a`` and ``b`` that the caching allocator did not reserve."""
    return (a[0] - b[0]) - (b[1] - a[1])


def engine_loop(
    target,
    order: Iterable[tuple[str, Iterable[int]]],
    warmups: int = 2,
    *,
    keep_copy: bool = False,
    free_after: bool = False,
    stop_at_oom: bool = False,
    driver_memory: bool = False,
) -> LoopRun:
    """The engines' hard-coded capture loop (SGLang's shape): for each ``(phase, sizes)``
    of ``order`` in turn, each size in the order given (:func:`largest_first` for the
    engines'), ``warmups`` eager runs on a side stream, then ``torch.cuda.graph`` on that
    stream into one pool shared by every phase; outputs kept alive.

    ``keep_copy``: persistent output buffers per graph, made during its first warm-up
    outside the pool, that the graph copies its outputs into (needs ``warmups >= 1``;
    vLLM's own capture, one buffer for every size, is bench/baselines.py's).
    ``free_after``: record :func:`free_bytes` after every capture (it synchronizes,
    which the timings then include). ``stop_at_oom``: an out-of-memory error
    ends the loop and is recorded in ``oom`` (a result, not a failure); else it raises.
    ``driver_memory``: record each graph with ``keep_graph=True`` and measure, apart, the
    driver memory its warm-ups, its recording, its instantiation and its first replay take
    and its nodes (``driver``; each synchronizes, and the graph is replayed once, which the
    engines' capture does not do: the driver may take memory at a graph's first launch, and
    that launch is an engine's first decode step). Releases nothing: :func:`release` does."""
    import torch

    run = LoopRun(pool=torch.cuda.graph_pool_handle())
    stream = torch.cuda.Stream()
    torch.cuda.synchronize()
    t_all = time.perf_counter()
    for phase, sizes in order:
        t0 = time.perf_counter()
        try:
            for bs in sizes:
                key = (phase, bs)
                cold = driver_state() if driver_memory else None
                with torch.cuda.stream(stream):
                    for _ in range(warmups):
                        w = outputs(target.run(phase, bs, None))
                        if keep_copy and key not in run.outs:
                            run.outs[key] = tuple(torch.empty_like(t) for t in w)
                        del w
                stream.synchronize()
                g = torch.cuda.CUDAGraph(keep_graph=driver_memory)
                before = driver_state() if driver_memory else None
                with torch.cuda.graph(g, pool=run.pool, stream=stream):
                    got = outputs(target.run(phase, bs, None))
                    if keep_copy:
                        for dst, src in zip(run.outs[key], got):
                            dst.copy_(src)
                        del got
                    else:
                        run.outs[key] = got
                if before is not None:
                    from capture_plan.executor.graph_nodes import instantiate_kept

                    recorded = driver_state()
                    nodes = instantiate_kept(g)
                    done = driver_state()
                    g.replay()
                    run.driver.append(
                        {
                            "bs": bs,
                            "nodes": nodes,
                            "warmup_bytes": outside_bytes(cold, before),
                            "record_bytes": outside_bytes(before, recorded),
                            "instantiate_bytes": outside_bytes(recorded, done),
                            "replay_bytes": outside_bytes(done, driver_state()),
                        }
                    )
                run.graphs[key] = g
                if free_after:
                    run.free_after.append(free_bytes())
        except torch.OutOfMemoryError:
            if not stop_at_oom:
                raise
            run.oom = f"{phase}/{bs}"
        torch.cuda.synchronize()
        run.phase_seconds[phase] = time.perf_counter() - t0
        if run.oom:
            break
    run.seconds = time.perf_counter() - t_all
    return run


class Replay(NamedTuple):
    """One replay of :func:`replays_vs_eager`."""

    phase: str
    bs: int
    #: the replay's outputs equal an eager run's on the same inputs, bit for bit
    equal: bool
    #: that eager run equals a second one (True where no second one ran)
    eager_equal: bool
    #: max |replay - eager| over the outputs (0.0 where equal)
    max_abs_diff: float


def _equal(a: tuple, b: tuple) -> bool:
    import torch

    return all(torch.equal(x, y) for x, y in zip(a, b))


def replays_vs_eager(target, run: LoopRun, gen, rounds: int = 1, eager_twice: bool = False) -> list[Replay]:
    """Replay every graph of ``run`` ``rounds`` times, each on fresh inputs
    (``target.prepare`` for ``bs`` requests), against an eager run of the same inputs;
    with ``eager_twice`` also that eager run against a second one (eager runs that
    differ: a nondeterministic kernel, not a capture fault). Compares every output of
    the graph (with ``keep_copy``: the buffers the graph copies into); releases
    nothing."""
    rows = []
    for _ in range(rounds):
        for (phase, bs), g in run.graphs.items():
            target.prepare(phase, bs, bs, gen)
            g.replay()
            got = tuple(t.clone() for t in run.outs[(phase, bs)])
            # an eager run may return a buffer the next one reuses: cloned
            ref = tuple(t.clone() for t in outputs(target.run(phase, bs, None)))
            again = _equal(ref, outputs(target.run(phase, bs, None))) if eager_twice else True
            equal = _equal(got, ref)
            diff = 0.0 if equal else max(float((a.float() - b.float()).abs().max()) for a, b in zip(got, ref))
            rows.append(Replay(phase, bs, equal, again, diff))
    return rows


def check_loop(target, run: LoopRun, gen) -> int:
    """Graphs of ``run`` whose replay differs from the eager run of the same inputs."""
    return sum(not r.equal for r in replays_vs_eager(target, run, gen))


def release(run: LoopRun | None = None) -> None:
    """Destroy ``run``'s graphs and drop its outputs, then collect, synchronize and empty
    the allocator's cache (without ``run``: only that), so that the next measurement
    starts from a pool-free device."""
    import torch

    if run is not None:
        for g in run.graphs.values():
            g.reset()
        run.graphs.clear()
        run.outs.clear()
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


# -- transformers models ----------------------------------------------------------------------

#: transformers architectures the benches build with random weights (no download): about
#: the width of small served models, few layers. name -> (config class in transformers,
#: its keyword arguments, attention implementation). Gemma2 (GeGLU MLP, pre- and
#: post-norms, logit soft-capping) runs eager attention.
HF_ARCHS: dict[str, tuple[str, dict[str, Any], str]] = {
    "llama": (
        "LlamaConfig",
        dict(
            hidden_size=2048,
            intermediate_size=5632,
            num_attention_heads=16,
            num_key_value_heads=8,
            num_hidden_layers=8,
            vocab_size=32000,
        ),
        "sdpa",
    ),
    "gemma2": (
        "Gemma2Config",
        dict(
            hidden_size=1152,
            intermediate_size=4608,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=128,
            num_hidden_layers=6,
            vocab_size=32000,
            sliding_window=4096,
        ),
        "eager",
    ),
    "qwen2": (
        "Qwen2Config",
        dict(
            hidden_size=1536,
            intermediate_size=8960,
            num_attention_heads=12,
            num_key_value_heads=2,
            num_hidden_layers=8,
            vocab_size=32000,
        ),
        "sdpa",
    ),
    "mixtral": (
        "MixtralConfig",
        dict(
            hidden_size=1024,
            intermediate_size=3584,
            num_attention_heads=16,
            num_key_value_heads=8,
            num_hidden_layers=4,
            vocab_size=32000,
            num_local_experts=8,
            num_experts_per_tok=2,
        ),
        "sdpa",
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        dict(
            hidden_size=1024,
            intermediate_size=2816,
            moe_intermediate_size=704,
            num_attention_heads=16,
            num_key_value_heads=16,
            num_hidden_layers=4,
            vocab_size=32000,
            num_experts=16,
            num_experts_per_tok=4,
            shared_expert_intermediate_size=2816,
        ),
        "sdpa",
    ),
    "deepseek_v3": (  # MLA: key and value head dims differ, every head attends
        "DeepseekV3Config",
        dict(
            hidden_size=1024,
            intermediate_size=2816,
            moe_intermediate_size=512,
            num_attention_heads=16,
            num_key_value_heads=16,
            kv_lora_rank=256,
            q_lora_rank=384,
            qk_nope_head_dim=64,
            qk_rope_head_dim=32,
            v_head_dim=64,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_shared_experts=1,
            n_group=2,
            topk_group=1,
            first_k_dense_replace=1,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            num_hidden_layers=4,
            vocab_size=32000,
        ),
        "sdpa",
    ),
}


def hf_config(name: str, **extra):
    """The transformers config of :data:`HF_ARCHS` ``name``, with ``extra`` keyword
    arguments on top (imports transformers)."""
    import transformers

    cls, kw, _ = HF_ARCHS[name]
    return getattr(transformers, cls)(**{**kw, **extra})


# -- the benchmarked cases: a plan's build options and its model --------------------------------

#: SGLang's decode sizes up to 256 (the default spec's), the sizes of the transformers cases
HF_DECODE = sgl_sizes("decode", 256)
#: the KV cache length of the transformers cases
HF_MAX_SEQLEN = 256


def startup_added(row: dict) -> dict | None:
    """What a first prediction adds to a start-up, for a case whose run has both the
    "executor" mode (the capture alone, in a fresh process) and the "startup" mode (the
    prediction, then the capture, in another fresh process): ``added_s`` = prediction +
    capture after it - capture alone. A prediction pays the process's first-use costs (the
    capture stream's cuBLAS handle and workspace, kernels loaded on their first launch, the
    first graph's driver set-up) that the capture after it then does not: its own time
    over the capture after it (``predict_of_capture``) counts them twice. Two processes,
    so the figure carries their noise (it can come out below 0). None without both modes."""
    ex, st = row.get("executor", {}), row.get("startup", {})
    if not isinstance(ex.get("capture_s"), float) or not isinstance(st.get("predict_s"), float):
        return None
    if not isinstance(st.get("capture_s"), float):
        return None
    added = st["predict_s"] + st["capture_s"] - ex["capture_s"]
    return {
        "predict_s": st["predict_s"],
        "capture_after_s": st["capture_s"],
        "capture_alone_s": ex["capture_s"],
        "added_s": added,
        "added_of_capture": added / ex["capture_s"] if ex["capture_s"] else None,
    }


def case_options(case: str, folder: Path, **config):
    """The ``BuildOptions`` of a bench case: "reference" (plans/fa3-ci.json's build),
    "eagle" (plans/fa3-eagle-ci.json's), or an :data:`HF_ARCHS` name, whose config
    (``config`` keyword arguments on top) is written to ``folder/config.json`` and
    named by a spec of the :data:`HF_DECODE` sizes."""
    from capture_plan.planner import BuildOptions

    if case == "reference":
        return BuildOptions(backend="fa3", ci=True)
    if case == "eagle":
        return BuildOptions(backend="fa3", ci=True, speculative="eagle")
    cfg = hf_config(case, **config, dtype="bfloat16")  # the dtype the target runs in
    (folder / "config.json").write_text(cfg.to_json_string())
    spec = folder / f"{case}.toml"
    spec.write_text(
        f'[model]\nconfig = "config.json"\n\n[[phases]]\nname = "decode"\nkind = "decode"\nsizes = {HF_DECODE}\n'
    )
    return BuildOptions(backend="torch", spec=spec)


def eagle_config(layers: int, max_bs: int):
    """The speculative reference's config of the "eagle" case: 3 draft steps, top-1."""
    from capture_plan.references.speculative import SpeculativeConfig
    from capture_plan.schemas.spec import Model

    return SpeculativeConfig(model=Model(layers=layers), max_bs=max_bs, num_steps=3, topk=1)


#: the share of the device's free memory (``torch.cuda.mem_get_info``, before the model is
#: built) a bench case's KV cache may take (every case of :func:`case_target`): the weights
#: (about 16 GiB at 32 layers), the activations and the graphs a bench captures take the
#: rest. The reference models keep a cache row per request slot, so EAGLE's 1025 slots at
#: 512 tokens (69 GiB) fit an H200 and not an H100 80GB (issue 49, item 7)
KV_SHARE = 0.6
#: the cache length of the reference cases where it fits (ReferenceConfig's default)
REFERENCE_SEQLEN = 512


class CaseDoesNotFit(CapturePlanError):
    """A bench case that does not fit the device it runs on: the bench skips it, saying why."""


def fit_seqlen(
    *,
    budget: int,
    slots: int,
    layers: int,
    kv_heads: int,
    head_dim: int,
    longest: int,
    page_size: int = 1,
    most: int = REFERENCE_SEQLEN,
    value_dim: int | None = None,
    fix: str = "run it on a device with more memory, or with fewer layers (--layers)",
) -> int:
    """The longest cache (tokens per request slot, a multiple of ``page_size``, at most
    ``most``) whose bf16 K and V for ``slots`` slots over ``layers`` layers fit ``budget``
    bytes (``value_dim``: V's head dim where it is not K's, as in MLA); refused
    (:class:`CaseDoesNotFit`, with ``fix``) where not even ``longest`` new tokens and one
    token of context fit."""
    per_token = slots * layers * kv_heads * (head_dim + (value_dim or head_dim)) * 2  # K and V, bf16
    seqlen = min(most, budget // per_token) // page_size * page_size
    if seqlen <= longest:
        need = (longest + page_size) // page_size * page_size * per_token
        raise CaseDoesNotFit(
            f"its KV cache ({slots} slots x {layers} layers) needs {need / MiB:.0f} MiB at the shortest "
            f"cache ({longest + 1} tokens); {KV_SHARE:.0%} of the device's free memory is {budget / MiB:.0f} MiB",
            where="bench.harness.case_target",
            fix=fix,
        )
    return seqlen


def hf_kv_shape(cfg) -> dict[str, int]:
    """The KV cache shape of a transformers config as ``HFTarget``'s static cache holds it,
    for :func:`fit_seqlen`: layers, K/V heads, K's head dim and V's. MLA (``kv_lora_rank``)
    caches its compressed latent as one head, ``kv_lora_rank`` wide in the keys and
    ``qk_rope_head_dim`` in the values (``HFTarget._allocate_cache``); tests/test_bench_sizing.py
    checks the shape against the cache ``HFTarget`` allocates for every :data:`HF_ARCHS` case."""
    cfg = cfg.get_text_config(decoder=True)
    if getattr(cfg, "kv_lora_rank", None):
        return {
            "layers": cfg.num_hidden_layers,
            "kv_heads": 1,
            "head_dim": cfg.kv_lora_rank,
            "value_dim": cfg.qk_rope_head_dim,
        }
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return {
        "layers": cfg.num_hidden_layers,
        "kv_heads": getattr(cfg, "num_key_value_heads", None) or heads,
        "head_dim": head_dim,
        "value_dim": head_dim,
    }


def does_not_fit(case: str, err: CaseDoesNotFit) -> str:
    """The line a bench prints and records for a case it skips on this device."""
    return f"{case} does not fit this device: {err}"


def kv_budget() -> int:
    """:data:`KV_SHARE` of the free device memory now (torch.cuda.mem_get_info)."""
    return int(free_bytes() * KV_SHARE)


def case_target(
    case: str,
    plan,
    layers: int = 32,
    *,
    max_bs: int | None = None,
    attention: str = "model",
    fa3_splits: int = 0,
    own_segments: bool = False,
    **config,
):
    """The model of a bench case for ``plan``, random weights on the GPU: the reference
    decode step or the speculative reference (``layers`` layers; they call FA3 themselves,
    with ``fa3_splits`` splits, their weights in segments of their own with
    ``own_segments``), or the transformers model of :data:`HF_ARCHS` (``config`` on top) in
    ``HFTarget``, with ``attention`` (``"model"``: the case's attention implementation;
    ``"fa3"``: FA3 over the cache as the engines' sm90 backends, ``fa3_splits``
    its split count: ``HFTarget``'s);
    sized for ``max_bs`` requests (default: the plan's largest size). Every
    case's cache length is sized for the device by :func:`fit_seqlen` within
    :func:`kv_budget`, read before the model is built: :data:`REFERENCE_SEQLEN` (the
    reference models) or :data:`HF_MAX_SEQLEN` (transformers) where it fits, shorter where
    not, read back from the target (``cfg.max_seqlen``, ``max_seqlen``); a case that cannot
    fit raises :class:`CaseDoesNotFit` before anything is allocated."""
    import torch

    from capture_plan.schemas.spec import Model

    if max_bs is None:
        max_bs = max(max(p.sizes) for p in plan.phases)
    budget = kv_budget()
    model = Model(layers=layers)
    if case == "reference":
        from capture_plan.references.decode import ReferenceConfig, ReferenceModel

        cfg = ReferenceConfig(model=model, max_bs=max_bs, fa3_splits=fa3_splits, own_segments=own_segments)
        seqlen = fit_seqlen(
            budget=budget,
            slots=max_bs,
            layers=layers,
            kv_heads=model.kv_heads,
            head_dim=model.head_dim,
            longest=max(cfg.tokens.values()),
        )
        return ReferenceModel(dataclasses.replace(cfg, max_seqlen=seqlen))
    if case == "eagle":
        from capture_plan.references.speculative import SpeculativeModel

        cfg = eagle_config(layers, max_bs)
        seqlen = fit_seqlen(
            budget=budget,
            slots=max_bs + 1,  # SpeculativeModel's padding row
            layers=layers + cfg.draft_layers,
            kv_heads=model.kv_heads,
            head_dim=model.head_dim,
            longest=max(cfg.num_draft_tokens, cfg.num_steps + 1),
            page_size=cfg.page_size,
        )
        return SpeculativeModel(
            dataclasses.replace(cfg, max_seqlen=seqlen, own_segments=own_segments, fa3_splits=fa3_splits)
        )
    import transformers

    from capture_plan.adapters.hf import HFTarget

    cfg = hf_config(case, **config)
    seqlen = fit_seqlen(
        budget=budget,
        slots=max_bs,
        longest=1,
        most=HF_MAX_SEQLEN,
        fix="run it on a device with more memory",  # the transformers cases' layers are their config's
        **hf_kv_shape(cfg),
    )
    cfg._attn_implementation = HF_ARCHS[case][2]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(device="cuda", dtype=torch.bfloat16).eval()
    return HFTarget(model, max_bs=max_bs, max_seqlen=seqlen, attention=attention, fa3_splits=fa3_splits)


def fitted_target(case: str, plan, layers: int = 32, *, max_bs: int | None = None, **config):
    """:func:`case_target`, or ``(None, why)`` where the case does not fit this device
    (:func:`does_not_fit`'s line): ``(target, None)`` otherwise. For a bench that skips
    the parts needing the model, saying why, and runs the rest."""
    try:
        return case_target(case, plan, layers, max_bs=max_bs, **config), None
    except CaseDoesNotFit as err:
        return None, does_not_fit(case, err)


def _claim_main() -> None:
    """``python -m bench.harness claim``: print the claim (:func:`claim`)."""
    if sys.argv[1:] != ["claim"]:
        print("usage: python -m bench.harness claim", file=sys.stderr)
        sys.exit(2)
    print(claim())


if __name__ == "__main__":  # python -m bench.harness claim: the value of CAPTURE_PLAN_COMMIT for a run elsewhere
    main_exit(_claim_main)
