"""Planner speed: wall time of the CLI and of builds as sizes grow.

Measures (median of --repeat runs, wall clock, on this machine's CPU):
  help              `planner --help` in a fresh process (import cost included)
  build_default     `planner build --backend fa3 --ci --dry-run` in a fresh process
  build_speculative `planner build --backend fa3 --ci --speculative eagle --dry-run` in a fresh process
  simulate_default  one simulation of the default plan's captures (in process)
  optimize_speculative  building the speculative preset in process (4 phases, all strategies)
  load_plan         capture_plan.executor.load_plan of plans/fa3-ci.json (decode, digest, fingerprint check)
  scale/N           a spec with N sizes in each of 4 phases, in process (N = 35 .. 2048; 4 x 2048
                    is the most schemas/limits.py allows: 8,192 sizes in all)
  exact_1024        the 1024 x 4 spec with --exact (strategies compared on every size), once
  work              per build above, in a separate untimed run: captures simulated and allocator
                    operations (allocations and frees) run; ns_per_op is simulate_default over its own
                    operations, so operations x ns_per_op is what simulating alone costs (the floor
                    of an op-by-op simulation at this speed); counted with the Python core (the
                    operations are the same with either), ns_per_op for each core
  quickstart        with --baseline PLANNER (another installation's `planner` script, e.g. of commit
                    2a7a316): the Quickstart build (`planner build --backend fa3 --ci`, writing its plan
                    into an empty folder) by this checkout's `planner` (--planner: an installation of
                    it, checked to hold this checkout's code; by default this interpreter's) and by
                    that one, whole processes alternating run by run, --quickstart-repeat each: wall
                    and CPU medians and their ratios (issue 31's target: at most 0.7x 2a7a316's);
                    where valgrind is installed, the instructions each executes too (one run each: a
                    count the machine's load does not move). Measure both sides installed as the
                    Quickstart installs them, `pip install .` (not editable: an editable install adds
                    its import hook to every process), each into its own venv; the JSON records
                    how each side is installed
  cores             each workload in process with both allocator cores (planner/memory/core.py's
                    core(): the compiled one and PoolSim), paired: the cores alternate run by run
                    (python, compiled, compiled, python, ...) after one untimed run of each, so that
                    drift in the machine's load hits both alike; medians, compiled over python, and
                    whether the plans are byte-identical. Workloads: the default plan, EAGLE's plan
                    (4 phases), the 1024 x 4 spec, a build from EAGLE's trace cut to the three sizes a
                    phase a start-up recording takes (bench.trace_build_bench), and the start-up
                    prediction's CPU part (adapters/startup.py: the analytic EAGLE schedule, then
                    that trace build). Left out where the compiled core is not built here.

The project's modules are byte-compiled first (what an installed package
has; this workplace sets PYTHONDONTWRITEBYTECODE, so without this every
fresh process would compile them again). The load average before and after
is recorded: other jobs on a shared machine slow every figure.

Writes JSON with date and machine to bench/results/build-<date>[-<tag>].json.
Run: python -m bench.build_bench [--repeat 5] [--tag NAME] [--no-exact] [--no-cores]
                                 [--baseline PLANNER [--planner PLANNER] [--quickstart-repeat N]]
     (the baseline, installed as the Quickstart does: git worktree add /tmp/old 2a7a316 && cd /tmp/old &&
      python3 -m venv .venv && .venv/bin/pip install . ; this checkout likewise, into a venv outside it:
      python3 -m venv /tmp/qs && /tmp/qs/bin/pip install . ; then
      --planner /tmp/qs/bin/planner --baseline /tmp/old/.venv/bin/planner)
     python -m bench.build_bench --python OTHER/bin/python --tag installed   (commands only, that installation)
     python -m bench.build_bench --python B/bin/python --against A/bin/python --tag ab
         (A/B: the commands alternate between the two installations run by run, so that drift in the
         machine's load hits both alike; wall and child CPU medians of each, and B/A ratios. Each side
         is run as `PYTHON -m capture_plan.planner ...` and nothing checks what it imports, so without
         network an installation can be `pip install --no-deps --no-build-isolation --no-index
         --target SITE CHECKOUT` with this interpreter's build tools, and PYTHON a two-line script
         `exec env PYTHONPATH=SITE /path/to/python "$@"`; the JSON names the two interpreters, not
         their commits: say those where the result is quoted)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.harness import (
    REPO,
    ResultFile,
    add_out_dir,
    add_overwrite,
    child_times,
    header,
    main_exit,
    median_time,
    result_file,
)

PYTHON = sys.executable  # --python: time the commands with another installation


def _core(name: str) -> None:
    """Run the allocator core ``name`` from now on in this process (its environment variable)."""
    from capture_plan.planner.memory.core import CORE_ENV, core

    os.environ[CORE_ENV] = name
    core.cache_clear()
    assert core().name == name, core()


def _work(fn) -> dict:
    """Captures simulated and allocator operations run by ``fn()`` (counted, not timed; with
    the Python core, whose ``run`` a counter can wrap, and the compiled core again after)."""
    from capture_plan.planner.memory.allocator import PoolSim
    from capture_plan.planner.memory.simulate import Simulation

    counts = {"captures": 0, "ops": 0}
    run, capture = PoolSim.run, Simulation.capture
    _core("python")

    def counting_run(self, ops, *a, **k):
        ops = tuple(ops)
        counts["ops"] += len(ops)
        return run(self, ops, *a, **k)

    def counting_capture(self, *a, **k):
        counts["captures"] += 1
        return capture(self, *a, **k)

    PoolSim.run, Simulation.capture = counting_run, counting_capture
    try:
        fn()
    finally:
        PoolSim.run, Simulation.capture = run, capture
        _core(CORE)
    return counts


CORE = "compiled"  # the core this run measures by default: "python" where the compiled one is not built


def _cores(repeat: int) -> dict:
    """Each workload with both cores in process, paired (see the module docstring)."""
    from bench.trace_build_bench import CASES, _trace
    from capture_plan.planner import BuildOptions, build_plan
    from capture_plan.schemas.codec import canonical_bytes

    trace, _, keep = CASES["fa3-eagle-ci, 3 recorded sizes a phase"]
    recorded = _trace(trace, keep, Path(tempfile.mkdtemp()))
    eagle = BuildOptions(backend="fa3", ci=True, speculative="eagle")
    eagle_trace = BuildOptions(backend="fa3", ci=True, speculative="eagle", trace=recorded)
    scale = BuildOptions(backend="fa3", ci=True, spec=_scale_spec(1024))  # one file: its path is in the plan
    workloads = {
        "default": lambda: build_plan(BuildOptions(backend="fa3", ci=True)),
        "eagle": lambda: build_plan(eagle),
        "scale_1024": lambda: build_plan(scale),
        "eagle_trace_3": lambda: build_plan(eagle_trace),
        # predict_startup: the schedule (the analytic build), then the build from the recording
        "startup_cpu": lambda: (build_plan(eagle), build_plan(eagle_trace))[1],
    }
    out: dict = {}
    for name, fn in workloads.items():
        plans, times = {}, {"python": [], "compiled": []}
        for which in ("python", "compiled"):  # untimed: programs built and cached, modules warm
            _core(which)
            plans[which] = canonical_bytes(fn())
        for i in range(repeat):
            for which in ("python", "compiled") if i % 2 == 0 else ("compiled", "python"):
                _core(which)
                t0 = time.perf_counter()
                fn()
                times[which].append(time.perf_counter() - t0)
        py, c = statistics.median(times["python"]), statistics.median(times["compiled"])
        out[name] = {
            "python_s": py,
            "compiled_s": c,
            "compiled_over_python": c / py,
            "identical": plans["python"] == plans["compiled"],
        }
        print(f"cores: {name} python {py:.3f} s, compiled {c:.3f} s ({c / py:.2f}x)", file=sys.stderr)
    _core(CORE)
    return out


def _cli(*args: str, python: str | None = None) -> tuple[float, float]:
    """Wall and CPU seconds of ``planner ARGS`` run by ``python`` (this bench's by default)."""
    return child_times([python or PYTHON, "-m", "capture_plan.planner", *args], cwd=tempfile.gettempdir(), env=_env())


def _env() -> dict[str, str]:
    from capture_plan.planner.memory.core import CORE_ENV

    return {k: v for k, v in os.environ.items() if k != CORE_ENV}  # the installation's own choice


#: the Quickstart's build (README.md), as a user runs it: the installation's `planner` script
QUICKSTART = ("build", "--backend", "fa3", "--ci")


def _quickstart(baseline: str, repeat: int, planner: str | None = None) -> dict:
    """The Quickstart build, whole processes, by ``planner`` (an installation of this
    checkout; by default this interpreter's ``planner`` script) and by ``baseline`` (another
    installation's ``planner`` script, e.g. of an older commit), alternating run by run
    (this, baseline, baseline, this, ...) after one untimed run of each, each in a new empty
    folder (it writes plans/fa3-ci.json there): medians of wall and CPU time and this one's
    over the baseline's. Both installations' modules are byte-compiled first (an installed
    package is at install; an editable one's checkout here)."""
    here = planner or str(Path(PYTHON).parent / "planner")
    install = {side: _install_kind(side) for side in (here, baseline)}
    if install[here] == "installed":
        _check_installed(here)
    checkout = Path(baseline).resolve().parent.parent.parent  # CHECKOUT/.venv/bin/planner
    commit = subprocess.run(["git", "-C", str(checkout), "rev-parse", "HEAD"], capture_output=True, text=True)
    for side in (here, baseline):
        py = str(Path(side).parent / "python")
        if install[side] == "editable":  # the checkout, but its venv and .git
            folder = str(REPO if side == here else checkout)
            subprocess.run([py, "-m", "compileall", "-q", "-x", r"[/\\]\.(venv|git)", folder], capture_output=True)
        for site in Path(side).parent.parent.glob("lib/python*/site-packages"):  # pip compiled them: a check
            subprocess.run([py, "-m", "compileall", "-q", str(site)], capture_output=True)

    def run(planner: str) -> tuple[float, float]:
        with tempfile.TemporaryDirectory() as folder:
            return child_times([planner, *QUICKSTART], cwd=folder, env=_env())

    run(here), run(baseline)
    med = _alternating(here, baseline, run, repeat)
    ir = {k: _instructions(k) for k in (here, baseline)}
    return {
        # where valgrind runs: instructions executed, one run each (the machine's load does not move them)
        "instructions": ir[here],
        "baseline_instructions": ir[baseline],
        "instructions_over_baseline": ir[here] / ir[baseline] if ir[here] and ir[baseline] else None,
        "command": "planner " + " ".join(QUICKSTART),
        "planner": here,
        "baseline": baseline,
        # "installed" (pip install ., as the Quickstart) or "editable" (pip install -e .), each side
        "install": install[here],
        "baseline_install": install[baseline],
        "baseline_commit": commit.stdout.strip() or None,
        "repeat": repeat,
        "wall_s": med[here][0],
        "cpu_s": med[here][1],
        "baseline_wall_s": med[baseline][0],
        "baseline_cpu_s": med[baseline][1],
        "wall_over_baseline": med[here][0] / med[baseline][0],
        "cpu_over_baseline": med[here][1] / med[baseline][1],
    }


def _install_kind(planner: str) -> str:
    """How the installation of the ``planner`` script (VENV/bin/planner) holds its package:
    "editable" (pip install -e: an import hook or a path file points at a checkout) or
    "installed" (pip install .: a copy in the venv's site-packages)."""
    site = list(Path(planner).parent.parent.glob("lib/python*/site-packages"))
    editable = any(next(s.glob(pattern), None) for s in site for pattern in ("__editable__*", "*.egg-link"))
    return "editable" if editable else "installed"


def _check_installed(planner: str) -> None:
    """Refuse an installation of the Quickstart side whose copy of the package is not this
    checkout's code or data (installed before the last change): its figure would be another
    commit's. The compiled core is not compared (the wheel holds no ``_core.pyx``)."""
    python = str(Path(planner).parent / "python")
    where = subprocess.run(
        [python, "-c", "import capture_plan, pathlib; print(pathlib.Path(capture_plan.__file__).parent)"],
        capture_output=True,
        text=True,
        cwd=tempfile.gettempdir(),
    )
    if where.returncode != 0:
        sys.exit(f"build_bench: {planner}: its python cannot import capture_plan: {where.stderr.strip()[-300:]}")
    package = Path(where.stdout.strip())
    for source in (
        # setup.py is the build's script, not the package's code (setuptools 80 leaves it out)
        sorted(f for f in REPO.glob("*.py") if f.name != "setup.py")
        + sorted(
            f
            for pkg in ("planner", "schemas", "executor", "adapters", "references")
            for f in (REPO / pkg).rglob("*.py")
        )
        + sorted((REPO / "planner" / "data").glob("*.toml"))
    ):  # the build reads them as much as the code
        copy = package / source.relative_to(REPO)
        if not copy.exists() or copy.read_bytes() != source.read_bytes():
            sys.exit(
                f"build_bench: --planner {planner}: its installation is not this checkout's code "
                f"({source.relative_to(REPO)} differs); fix: {python} -m pip install {REPO}"
            )


def _instructions(planner: str) -> int | None:
    """Instructions the Quickstart build by ``planner`` executes (valgrind's callgrind, in an
    empty folder), or None where valgrind is not installed. Run by the script's interpreter
    (a console script's first line names it), as valgrind follows no ``#!``."""
    import re
    import shutil

    if not shutil.which("valgrind"):
        return None
    python = str(Path(planner).parent / "python")
    with tempfile.TemporaryDirectory() as folder:
        r = subprocess.run(
            ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", python, planner, *QUICKSTART],
            cwd=folder,
            env=_env(),
            capture_output=True,
            text=True,
        )
    found = re.search(r"Collected : (\d+)", r.stderr)
    return int(found.group(1)) if r.returncode == 0 and found else None


def _alternating(a: str, b: str, run, repeat: int) -> dict[str, tuple[float, float]]:
    """``run(a)`` and ``run(b)`` (each returning wall and CPU seconds), ``repeat`` times each,
    alternating (a, b, b, a, ...) so that drift in the machine's load hits both alike: the
    medians of wall and CPU time of each."""
    samples: dict = {a: ([], []), b: ([], [])}
    for i in range(repeat):
        for side in (a, b) if i % 2 == 0 else (b, a):
            wall, cpu = run(side)
            samples[side][0].append(wall)
            samples[side][1].append(cpu)
    return {k: (statistics.median(w), statistics.median(c)) for k, (w, c) in samples.items()}


COMMANDS = {
    "help": ("--help",),
    "build_default": ("build", "--backend", "fa3", "--ci", "--dry-run"),
    "build_speculative": ("build", "--backend", "fa3", "--ci", "--speculative", "eagle", "--dry-run"),
}


def _ab(a: str, b: str, repeat: int, only: list[str] | None = None) -> dict:
    """Each command run ``repeat`` times by each interpreter, alternating (a, b, b, a, ...): medians of
    wall time and of the child's CPU time (user + system), and b's medians over a's."""
    out: dict = {}
    for name, args in COMMANDS.items():
        if only and name not in only:
            continue
        med = _alternating(a, b, lambda py, args=args: _cli(*args, python=py), repeat)
        out[name] = {
            "a_wall_s": med[a][0],
            "b_wall_s": med[b][0],
            "a_cpu_s": med[a][1],
            "b_cpu_s": med[b][1],
            "b_over_a_wall": med[b][0] / med[a][0],
            "b_over_a_cpu": med[b][1] / med[a][1],
        }
    return out


def _scale_spec(n: int) -> Path:
    sizes = list(range(1, n + 1))
    text = ""
    for name, kind, tpr in (
        ("decode", "decode", 1),
        ("target_verify", "target_verify", 4),
        ("draft_decode", "draft_decode", 1),
        ("draft_extend", "draft_extend", 4),
    ):
        text += f'[[phases]]\nname = "{name}"\nkind = "{kind}"\ntokens_per_request = {tpr}\nsizes = {sizes}\n'
        if kind.startswith("draft"):
            text += "layers = 1\n"
    path = Path(tempfile.mkdtemp()) / f"scale{n}.toml"
    path.write_text(text)
    return path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=5)
    add_out_dir(ap)
    ap.add_argument("--tag", default="", help="file name suffix: build-<date>-<tag>.json")
    add_overwrite(ap)
    ap.add_argument("--no-exact", action="store_true", help="skip the --exact 1024 x 4 build (tens of seconds)")
    ap.add_argument("--no-cores", action="store_true", help="skip the in-process comparison of the allocator cores")
    ap.add_argument(
        "--baseline",
        metavar="PLANNER",
        help="the `planner` script of another installation (CHECKOUT/.venv/bin/planner, e.g. of commit 2a7a316): "
        "the Quickstart build's whole process against it, alternating",
    )
    ap.add_argument(
        "--planner",
        metavar="PLANNER",
        help="with --baseline: the `planner` script of this checkout's installation to time (VENV/bin/planner, "
        "e.g. of `pip install .` into its own venv, as the Quickstart installs; checked to hold this checkout's "
        "code); default: this interpreter's",
    )
    ap.add_argument("--quickstart-repeat", type=int, default=20, help="runs of each side with --baseline (default 20)")
    ap.add_argument(
        "--against",
        metavar="PYTHON",
        help="A/B: alternate the commands between this interpreter (a) and --python (b), run by run",
    )
    ap.add_argument("--only", action="append", choices=sorted(COMMANDS), help="A/B: only this command (repeatable)")
    ap.add_argument(
        "--python",
        help="time only the commands (help, builds), run by this interpreter: e.g. a "
        "virtual environment where `pip install .` installed capture-plan (no editable path finder)",
    )
    args = ap.parse_args()
    if args.against and not args.python:
        ap.error("--against needs --python (the b side)")
    if args.planner and not args.baseline:
        ap.error("--planner needs --baseline (the side it is timed against)")
    global PYTHON
    PYTHON = args.python or sys.executable
    res: dict = header(device=False)
    out = result_file(args, "build", res["date"], args.tag)

    import compileall

    for pkg in ("planner", "schemas", "executor"):
        compileall.compile_dir(str(REPO / pkg), quiet=1)

    from capture_plan.planner import BuildOptions, build_plan
    from capture_plan.planner.inputs.resources import backend
    from capture_plan.planner.inputs.specs import default_spec
    from capture_plan.planner.memory.core import core
    from capture_plan.planner.memory.simulate import simulate
    from capture_plan.planner.memory.workload import Workload

    res.update(repeat=args.repeat, bytecode="compiled before timing", loadavg_before=os.getloadavg())
    res["help_s"] = median_time(lambda: _cli("--help"), args.repeat)
    res["build_default_s"] = median_time(lambda: _cli("build", "--backend", "fa3", "--ci", "--dry-run"), args.repeat)
    res["build_speculative_s"] = median_time(
        lambda: _cli("build", "--backend", "fa3", "--ci", "--speculative", "eagle", "--dry-run"), args.repeat
    )
    if args.against:
        res.update(a=args.against, b=args.python, ab=_ab(args.against, args.python, args.repeat, args.only))
        return _write(
            res,
            out,
            "b/a: "
            + ", ".join(
                f"{name} wall {v['b_over_a_wall']:.3f} cpu {v['b_over_a_cpu']:.3f} ({v['a_wall_s']:.3f} -> "
                f"{v['b_wall_s']:.3f} s)"
                for name, v in res["ab"].items()
            ),
        )
    if args.python:
        res["python"] = args.python
        res["install"] = subprocess.run(
            [
                PYTHON,
                "-c",
                "import capture_plan.planner as planner, pathlib; "
                "print('editable' if pathlib.Path(planner.__file__).resolve().parent.parent"
                ".joinpath('.git').exists() "
                "else 'installed')",
            ],
            capture_output=True,
            text=True,
            cwd=tempfile.gettempdir(),
        ).stdout.strip()
        return _write(
            res,
            out,
            f"{res['python']} ({res['install']}): default build {res['build_default_s']:.3f} s, "
            f"speculative {res['build_speculative_s']:.3f} s, help {res['help_s']:.3f} s",
        )
    global CORE
    CORE = core().name
    res["core"] = core().describe()  # the core of every figure below but cores and work
    if args.baseline:
        res["quickstart"] = q = _quickstart(args.baseline, args.quickstart_repeat, args.planner)
        print(
            f"quickstart: {q['wall_s']:.3f} s against {q['baseline_wall_s']:.3f} s "
            f"({q['wall_over_baseline']:.2f}x wall, {q['cpu_over_baseline']:.2f}x CPU)",
            file=sys.stderr,
        )
    if CORE == "compiled" and not args.no_cores:
        res["cores"] = _cores(args.repeat)
        _write(res, out, "cores measured, the rest under way")  # a run cut short keeps them
    plan = build_plan(BuildOptions(backend="fa3", ci=True))
    spec = default_spec()
    wl = Workload.analytic(spec.model, spec.phases, backend("fa3"))
    caps = [(s.phase, s.bs) for s in plan.steps if s.op == "capture"]
    strategies = {p.name: p.strategy for p in plan.phases}
    res["simulate_default_s"] = median_time(lambda: simulate(caps, strategies, wl), args.repeat)
    res["optimize_speculative_s"] = median_time(
        lambda: build_plan(BuildOptions(backend="fa3", ci=True, speculative="eagle")), args.repeat
    )
    from capture_plan.executor import Environment, load_plan

    env = Environment("NVIDIA H200", (9, 0), "2.11.0", frozenset({"fa3_fwd_interface"}))
    path = REPO / "plans/fa3-ci.json"
    res["load_plan_s"] = median_time(lambda: [load_plan(path, env=env) for _ in range(100)], args.repeat) / 100
    res["scale"] = {}
    for n in (35, 128, 512, 1024, 2048):
        path = _scale_spec(n)
        res["scale"][str(n)] = median_time(
            lambda path=path: build_plan(BuildOptions(backend="fa3", ci=True, spec=path)), max(1, args.repeat // 2)
        )
    if not args.no_exact:
        path = _scale_spec(1024)
        res["exact_1024_s"] = median_time(
            lambda: build_plan(BuildOptions(backend="fa3", ci=True, spec=path, exact=True)), 1
        )
    work = {
        "simulate_default": _work(lambda: simulate(caps, strategies, wl)),
        "build_default": _work(lambda: build_plan(BuildOptions(backend="fa3", ci=True))),
        "build_speculative": _work(lambda: build_plan(BuildOptions(backend="fa3", ci=True, speculative="eagle"))),
    }
    path = _scale_spec(1024)
    work["scale_1024"] = _work(lambda: build_plan(BuildOptions(backend="fa3", ci=True, spec=path)))
    if not args.no_exact:
        work["exact_1024"] = _work(lambda: build_plan(BuildOptions(backend="fa3", ci=True, spec=path, exact=True)))
    _core("python")
    ns = median_time(lambda: simulate(caps, strategies, wl), args.repeat) / work["simulate_default"]["ops"] * 1e9
    _core(CORE)
    for w in work.values():
        w["simulating_s_at_ns_per_op"] = round(w["ops"] * ns * 1e-9, 3)
    res["work"] = {
        "ns_per_op": round(ns),
        f"ns_per_op_{CORE}": round(res["simulate_default_s"] / work["simulate_default"]["ops"] * 1e9),
        **work,
    }
    scale = res["scale"]
    cores = res.get("cores", {})
    q = res.get("quickstart")
    _write(
        res,
        out,
        (
            f"quickstart build {q['wall_over_baseline']:.2f}x wall, {q['cpu_over_baseline']:.2f}x CPU"
            + (f", {q['instructions_over_baseline']:.2f}x instructions" if q["instructions_over_baseline"] else "")
            + " of "
            + f"{(q['baseline_commit'] or q['baseline'])[:7]} ({q['baseline_wall_s']:.3f} -> {q['wall_s']:.3f} s); "
            if q
            else ""
        )
        + (
            "compiled/python core: "
            + ", ".join(
                f"{k} {v['compiled_over_python']:.2f}x ({v['python_s']:.2f} -> {v['compiled_s']:.2f} s)"
                for k, v in cores.items()
            )
            + (", plans identical; " if all(v["identical"] for v in cores.values()) else ", PLANS DIFFER; ")
            if cores
            else ""
        )
        + f"{CORE} core: default build {res['build_default_s']:.3f} s, speculative {res['build_speculative_s']:.3f} s "
        f"(in process {res['optimize_speculative_s']:.3f} s), 1024x4 {scale['1024']:.2f} s, 2048x4 "
        f"{scale['2048']:.2f} s"
        + (f", --exact 1024x4 {res['exact_1024_s']:.1f} s" if "exact_1024_s" in res else "")
        + f"; {ns:.0f} ns per allocator op (python core): "
        + ", ".join(
            f"{k} {w['captures']:,} captures {w['ops'] / 1e6:.2f} M ops = {w['simulating_s_at_ns_per_op']:.2f} s"
            for k, w in work.items()
            if k != "simulate_default"
        ),
    )


def _write(res: dict, out: ResultFile, summary: str) -> None:
    res["loadavg_after"] = os.getloadavg()
    out.write(res)
    print(json.dumps(res, indent=2, sort_keys=True))
    print(f"{out.path.name}: {summary}; load {res['loadavg_before'][0]:.1f} -> {res['loadavg_after'][0]:.1f}")


if __name__ == "__main__":
    main_exit(main)
