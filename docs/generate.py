"""Generate the docs' derived parts: measurement tables and the CLI reference.

    python docs/generate.py          # rewrite them in place
    python docs/generate.py --check  # exit 1, naming each stale file, if any differs

Measurement tables live in marked regions of the docs' markdown::

    <!-- table: capture -->
    ... rendered from bench/results/capture-2026-11-29-32l.json ...
    <!-- /table -->

Each region's name is a key of ``TABLES``; its renderer reads one JSON file of
``bench/results/`` (which carries the run's date and device) and ends the table
with a line naming that file. Only the region's body is rewritten.

A figure quoted in prose is an inline region of its own, in the pages and the README::

    the pool is <!-- fig: capture-executor-pool -->258 MiB<!-- /fig --> (<!-- fig: source
    capture-2026-11-29-32l.json -->`bench/results/capture-2026-11-29-32l.json`<!-- /fig -->)

Each name is a key of ``FIGURES``, which names the JSON files the figure is computed
from; ``source FILE`` renders the file's name and its provenance (a result measured
from uncommitted changes, or with no commit recorded, says so). tests/test_doc_figures.py
checks that every figure's paragraph names each of its files through a ``source``
region, and that every number with a unit in a paragraph that names a result is one
of these regions.
``docs/cli.md`` is generated whole from the ``planner`` command group's help
(click's own formatting, at a fixed width so the text is the same on any
terminal). Not part of the shipped package: it runs from a checkout with the
package installed (``pip install -e .``), and tests/test_readme.py checks that
the committed files are what it writes.
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
RESULTS = ROOT / "bench" / "results"
REGION = re.compile(r"(<!-- table: (?P<name>[a-z0-9-]+) -->\n)(?P<body>.*?)(<!-- /table -->)", re.S)
CLI_PAGE = DOCS / "cli.md"
#: the help's width: fixed, so the page does not depend on the terminal it was generated in
CLI_WIDTH = 100
MiB = 2**20


def _load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def _mib(x: float) -> str:
    return f"{x:,.0f}"


def _pct(x: float, digits: int = 1) -> str:
    return f"{x * 100:+.{digits}f}%"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def provenance(data: dict) -> str:
    """How a result's code is known, for the line that names it: "" for a clean commit;
    else what is missing (no commit recorded; uncommitted changes, with the diff's digest
    where the header has it)."""
    commit, dirty = data.get("git_commit"), data.get("git_dirty")
    if not commit:
        return "no commit recorded"
    if dirty is None:
        return f"commit `{commit[:7]}`, not recorded whether its tree had changes"
    if dirty and data.get("git_tree") and not data.get("git_diff_sha256"):
        # a claimed run (bench.harness claim) on a copy: the copy's tree id is known, its diff is not
        return f"the measured copy held files beyond commit `{commit[:7]}` (its tree `{data['git_tree'][:7]}`)"
    if dirty:
        digest = data.get("git_diff_sha256")
        diff = f", diff sha256 `{digest[:12]}`" if digest else ", the diff not recorded"
        return f"measured from uncommitted changes to `{commit[:7]}`{diff}"
    return ""


def _source(name: str, data: dict) -> str:
    what = ", ".join(f"{label}{data[k]}" for k, label in (("device", ""), ("torch", "torch ")) if k in data)
    known = provenance(data)
    when = f"{what}{', ' if what else ''}{data['date'][:10]}{'; ' + known if known else ''}"
    return f"\nSource: `bench/results/{name}` ({when})."


def _also(label: str, name: str) -> str:
    """A second file a table reads: `` label: `bench/results/name` (provenance).``"""
    known = provenance(_load(name))
    return f" {label}: `bench/results/{name}`{f' ({known})' if known else ''}."


def _equal(replays: int, unequal: int) -> str:
    return f"{replays - unequal}/{replays}"


def _schedule(label: str, run: dict, bold: bool = False) -> list[str]:
    """A capture-benchmark row: schedule, pool MiB, capture s, replays equal to eager (the
    loop's runs count ``graphs``, the executor's ``replays``)."""
    cells = [label, _mib(run["pool_mib"]), f"{run['capture_s']:.2f}"]
    if bold:
        cells = [f"**{c}**" for c in cells]
    return [*cells, _equal(run.get("replays", run.get("graphs")), run["replays_not_equal_eager"])]


def capture() -> list[str]:
    name = CAPTURE
    d = _load(name)
    e = d["executor"]
    rows = [
        ["largest size captured alone", _mib(d["alone"]["pool_mib"]), "-", "-"],
        _schedule("SGLang-style loop: largest-first, outputs kept, 2 warm-ups per size", d["sglang"]),
        _schedule("smallest-first, outputs kept (the reverted CI gate)", d["ascending"]),
        _schedule(f"executor with `plans/{d['plan']}`", e, bold=True),
    ]
    r = d["ratios"]
    return [
        *_table(["schedule", "pool MiB", "capture s", "replays equal eager"], rows),
        "",
        f"Executor against the loop: pool {r['pool_vs_sglang']:.2f}x, capture time {r['capture_time_vs_sglang']:.2f}x;"
        f" pool {r['pool_vs_alone']:.2f}x of the largest graph alone. Prediction: analytic"
        f" {_mib(e['predicted_analytic_mib'])} MiB ({_pct(e['analytic_error'])}), from the recorded trace"
        f" {_mib(e['predicted_trace_mib'])} MiB ({_pct(e['trace_error'])}). `{e['verify_all']}`.",
        _source(name, d),
    ]


def speculative() -> list[str]:
    name = "speculative-2026-11-29-32l.json"
    d = _load(name)
    floors = d["floors_mib"]
    loop, gate = d["loop"], d["gate"]
    parts = " + ".join(f"{k.removeprefix('phase:')} {_mib(v)}" for k, v in sorted(floors.items()))
    rows = [
        [f"each pool's largest graph alone ({parts})", _mib(sum(floors.values())), "-", "-"],
        _schedule("engines' loop: every phase largest-first, outputs kept, 2 warm-ups per size, one pool", loop),
        _schedule("the reverted gate: target_verify and draft_extend smallest-first, outputs kept", gate),
        _schedule("executor with `plans/fa3-eagle-ci.json`", d["fa3-eagle-ci.json"], bold=True),
        _schedule("executor with `plans/fa3-eagle.json`", d["fa3-eagle.json"]),
    ]
    ci = d["fa3-eagle-ci.json"]
    pools = ", ".join(
        f"{k.removeprefix('phase:')} {_mib(v['predicted_mib'])} MiB against {_mib(v['measured_mib'])} measured"
        for k, v in sorted(ci["pools"].items())
    )
    return [
        *_table(["schedule", "pool MiB", "capture s (this run)", "replays equal eager"], rows),
        "",
        f"Executor against the loop: pool {ci['pool_mib'] / loop['pool_mib']:.3f}x;"
        f" {ci['pool_mib'] / sum(floors.values()):.3f}x the sum of its pools' floors. Analytic prediction per pool:"
        f" {pools}. `{ci['verify']}` (each plan).",
        _source(name, d),
    ]


def bugs() -> list[str]:
    name = "speculative-2026-11-29-32l.json"
    d = _load(name)

    def cell(key: str) -> str:
        b = d["bugs"][key]
        checks = " + ".join(f"{n} {c}" for c, n in sorted(b["by_check"].items()))
        by_phase: dict[str, list[int]] = {}
        for graph in b["graphs_named"]:
            phase, size = graph.split("/")
            by_phase.setdefault(phase, []).append(int(size))
        blamed = "; ".join(f"{phase} {', '.join(map(str, sorted(s)))}" for phase, s in sorted(by_phase.items()))
        return f"{checks} faults; blamed: {blamed}"

    rows = [
        [f"`{bug}`", cell(f"{bug}/planned"), cell(f"{bug}/smallest-first")]
        for bug in sorted({k.split("/")[0] for k in d["bugs"]})
    ]
    wild = d["wild"]
    named = sum("VerificationFailed" in w["line"] or "CUDA context is lost" in w["line"] for w in wild.values())
    sanitizer = sum("compute-sanitizer --tool memcheck" in w["line"] for w in wild.values())
    sizes = ", ".join(sorted(wild, key=int))
    rows.append(
        [
            f"`wild` (sizes {sizes}, each alone)",
            f'{named}/{len(wild)}: "CUDA context is lost", naming the draft_extend graph;'
            f" {sanitizer}/{len(wild)} give the `compute-sanitizer --tool memcheck` line",
            "-",
        ]
    )
    return [*_table(["bug", "planned order", "smallest-first (the reverted gate)"], rows), _source(name, d)]


_MODEL_LABELS = {
    "llama": "Llama, {layers} layers",
    "mixtral": "Mixtral",
    "qwen2_moe": "Qwen2-MoE",
    "qwen2_moe@expandable": "Qwen2-MoE, expandable segments",
    "gemma2": "Gemma2, {layers} layers",
}
_KERNELS = {"EFFICIENT_ATTENTION": "efficient", "FLASH_ATTENTION": "flash", "MATH": "math", "CUDNN_ATTENTION": "cuDNN"}


def models() -> list[str]:
    name = "models-2026-11-29.json"
    d = _load(name)
    rows = []
    for arch, label in _MODEL_LABELS.items():
        a = d["archs"][arch]
        text = label.format(layers=a["config"]["num_hidden_layers"])
        if "@" not in arch:
            text += f" ({a['attention']})"
        e, an, v = a["executor"], a["analytic"], a["verify"]
        check = a.get("attention_check")
        if check:
            sdpa = " / ".join(
                f"{_KERNELS[c['kernel']['256']]}: {c['replay_not_equal_eager']}, {c['eager_not_equal_eager']}"
                for c in (check["pinned"], check["pytorch_default"])
            )
        else:
            sdpa = "-"
        verdict = "no faults" if v["faults"] == 0 else f"{v['faults']} faults"
        rows.append(
            [
                text,
                _mib(a["loop"]["pool_mib"]),
                _mib(a["alone_mib"]),
                f"{_mib(e['pool_mib'])} ({e['predicted_mib']:.1f}, {_pct(e['pool_error'])})",
                f"{_mib(an['predicted_mib'])} ({_pct(an['error'], 0)})",
                f"{v['replays']} replays, {verdict}",
                sdpa,
            ]
        )
    header = [
        "model (attention)",
        "loop MiB",
        "largest alone MiB",
        "executor MiB (predicted from 3 sizes)",
        "analytic from config.json MiB (error)",
        "verify",
        "SDPA: replays != eager, eager != eager, of 24 (pinned / PyTorch's choice)",
    ]
    return [*_table(header, rows), _source(name, d) + f" transformers {d['transformers']}."]


#: the engines' loop mode's last run (not re-measured since): its drops for the reference and EAGLE
LOOP_RUN = "device-2026-12-01.json"


def device() -> list[str]:
    """The executor's device items from the last start-up run's ``executor`` mode, beside the
    engines' loop's drop from :data:`LOOP_RUN`, the one run that measured it."""
    name = STARTUP_RUN
    d, loops = _load(name), _load(LOOP_RUN)
    rows = []
    for case, plan in (("reference", "fa3-ci"), ("eagle", "fa3-eagle-ci")):
        c = d["cases"][case]
        e = c["executor"]
        items = e["items_mib"]
        parts = (
            f"{_mib(items['pool'])} + {_mib(items['allocator-held'])} workspace"
            f" + {_mib(items['allocator-cached'])} allocator + {_mib(items['outside-allocator'])} driver"
        )
        rows.append(
            [
                f"{plan} ({c['captures']} graphs)",
                _mib(e["pool_mib"]),
                f"{_mib(e['drop_mib'])} ({parts})",
                _mib(loops["cases"][case]["loop"]["drop_mib"]),
            ]
        )
    header = ["plan", "pool MiB", "free-memory drop MiB, executor", "engines' loop drop MiB (its own run)"]
    return [*_table(header, rows), _source(name, d) + _also("The engines' loop", LOOP_RUN)]


_STARTUP = {
    "reference": "reference decode (32 layers)",
    "llama": "Llama (dense)",
    "gemma2": "Gemma2 (dense)",
    "qwen2": "Qwen2 (dense)",
    "mixtral": "Mixtral (MoE)",
    "qwen2_moe": "Qwen2-MoE (MoE)",
    "eagle": "EAGLE, four phases",
}
#: the start-up prediction's last run: startup, executor and startup-cached modes, every case
#: (it replaced device-2026-12-01-startup-final.json and device-2026-12-01-startup-cached.json)
STARTUP_RUN = "device-2026-12-02-startup.json"
#: the run that measured the bench's earlier "vllm" mode on the same cases: each phase's two
#: largest sizes in a fresh pool, ``first + (n - 1) * second`` (not vLLM 0.33's method, which
#: :data:`ENGINES` measured: docs/measurements.md)
EXTRAPOLATION = "device-2026-12-01-startup-all.json"
#: the same cases at the start of that session (EAGLE's draft phases recorded at every size)
STARTUP_BEFORE = "device-2026-12-01-startup-timed.json"
#: the start-up prediction's newest clean run of all seven cases (startup mode alone): the
#: README's steps-within and first-prediction figures (the start-up floor table has every run)
STARTUP_LATEST = "device-2026-12-04-bf16-priming.json"


def startup_prediction() -> list[str]:
    last = _load(STARTUP_RUN)
    rows = []
    for case, label in _STARTUP.items():
        c = last["cases"][case]
        s, ex = c["startup"], c["executor"]
        at_peak = s["slack_mib"] - (s["measured_peak_mib"] - s["measured_drop_mib"])
        after = s["measured_drop_mib"] + s["final_error_mib"]
        rows.append(
            [
                label,
                f"{_mib(s['pending_mib'])} / {_mib(s['measured_peak_mib'])} ({_pct(s['error'], 2)})",
                f"{_mib(after)} / {_mib(s['measured_drop_mib'])}",
                f"{_mib(s['predicted_total_mib'])} / {_mib(ex['drop_mib'])}",
                s["steps_within_1pct_or_2mib"],
                f"{at_peak:+.0f}",
                f"{_pct(ex['analytic_error'], 0)}",
            ]
        )
    header = [
        "model",
        "peak MiB: predicted / taken",
        "after capture MiB: predicted / taken",
        "whole capture, fresh process MiB: predicted / executor's drop",
        "steps within 1% or 2 MiB",
        "KV slack at the peak MiB",
        "analytic pool error",
    ]
    return [*_table(header, rows), _source(STARTUP_RUN, last)]


#: a first start-up (records, writes the calibration) and a later one (reads it), each in a
#: fresh process, every case
STARTUP_CACHED = STARTUP_RUN


def startup_cached() -> list[str]:
    return _startup_cached(STARTUP_CACHED)


def _predict_share(run: dict) -> str:
    return f"{run['predict_s']:.2f} / {run['capture_s']:.2f} ({run['predict_s'] / run['capture_s']:.0%})"


def _startup_cached(name: str) -> list[str]:
    d = _load(name)
    rows = []
    for case, label in _STARTUP.items():
        row = d["cases"].get(case, {})
        if "startup-cached" not in row:  # a run stopped at its time limit: said, not left out
            first = row.get("startup")
            rows.append([label, _predict_share(first) if first else "not measured", *["not measured"] * 6])
            continue
        first, later = row["startup"], row["startup-cached"]
        after = later["measured_drop_mib"] + later["final_error_mib"]
        rows.append(
            [
                label,
                _predict_share(first),
                f"{later['predict_s']:.3f} / {later['capture_s']:.2f} ({later['predict_s'] / later['capture_s']:.1%})",
                f"{_mib(later['pending_mib'])} / {_mib(later['measured_peak_mib'])} ({_pct(later['error'], 2)})",
                f"{_mib(after)} / {_mib(later['measured_drop_mib'])}",
                f"{later['steps_within_1pct_or_2mib']}, {later['steps_above']} above",
                ("held" if later["confirm_ok"] else "missed: entry removed")
                + ("" if later["source"] == "cache" else " (recorded: no entry read)"),
                f"{later['slack_mib'] - (later['measured_peak_mib'] - later['measured_drop_mib']):+.0f}",
            ]
        )
    header = [
        "model",
        "first start-up: predict s / capture s",
        "later start-up: predict s / capture s",
        "later: peak MiB predicted / taken",
        "later: after capture MiB predicted / taken",
        "later: steps within 1% or 2 MiB, steps taking more than predicted",
        "confirm_startup",
        "later: KV slack at the peak MiB",
    ]
    return [*_table(header, rows), _source(name, d)]


def startup_time() -> list[str]:
    last, before = _load(STARTUP_RUN), _load(STARTUP_BEFORE)
    rows = []
    for case, label in _STARTUP.items():
        c = last["cases"][case]
        s, ex, b = c["startup"], c["executor"], before["cases"][case]["startup"]
        parts = s["predict_parts_s"]
        recorded = max(len(v) for v in s["recorded"].values())
        rows.append(
            [
                label,
                f"{b['predict_s']:.2f} ({max(len(v) for v in b['recorded'].values())})",
                f"{s['predict_s']:.2f} ({recorded})",
                f"{parts['record.capture']:.2f}",
                f"{parts['record.copies']:.2f}",
                f"{parts['build']:.2f}",
                f"{s['capture_s']:.2f} / {ex['capture_s']:.2f}",
                f"{s['predict_s'] / s['capture_s']:.0%}",
            ]
        )
    header = [
        "model",
        "predict s before (most sizes recorded in a phase)",
        "predict s now (most sizes recorded)",
        "recording s",
        "graph copies s",
        "build from the trace s",
        "capture s: after the prediction / fresh process",
        "predict / capture",
    ]
    return [
        *_table(header, rows),
        _source(STARTUP_RUN, last) + _also("Before", STARTUP_BEFORE),
    ]


#: the engines' own estimators on the start-up cases: vLLM 0.33.0's profile_cudagraph_memory
#: against vLLM-style capture of the same graphs, and SGLang 0.5.23's reserve (its "timing"
#: rows failed, a bug fixed after: TIMING measured replay times instead)
ENGINES = "device-2026-12-02-engines.json"


def engines() -> list[str]:
    """Each engine's estimate beside what it is for: vLLM's against its own capture of the
    graphs it estimated (vLLM's 51 default sizes); SGLang's reserve and capture-plan's
    prediction against the capture of the case's plan (SGLang's 36 decode sizes), from
    :data:`STARTUP_RUN`."""
    d, run = _load(ENGINES), _load(STARTUP_RUN)
    rows = []
    for case, label in _STARTUP.items():
        v, g = d["cases"][case]["vllm"], d["cases"][case]["sglang"]
        s, ex = run["cases"][case]["startup"], run["cases"][case]["executor"]
        first, second = v["samples_mib"]
        plan_error = (s["predicted_total_mib"] - ex["drop_mib"]) / ex["drop_mib"]
        rows.append(
            [
                label,
                str(v["graphs"]),
                f"{_mib(v['estimate_mib'])} / {_mib(v['vllm_capture_drop_mib'])} ({_pct(v['error'], 0)})",
                f"{first:+,.0f}, {second:+,.0f}",
                f"{v['seconds']:.2f}",
                f"{_mib(g['reserve_mib'])} ({_mib(g['decode_term_mib'])})",
                f"{_mib(s['predicted_total_mib'])} / {_mib(ex['drop_mib'])} ({_pct(plan_error, 1)})",
                f"{_mib(s['pending_mib'])} / {_mib(s['measured_peak_mib'])}",
            ]
        )
    header = [
        "model",
        "vLLM graphs",
        "vLLM 0.33 estimate / vLLM-style capture's drop MiB (error)",
        "vLLM's FULL samples MiB (largest, second)",
        "vLLM estimate s",
        "SGLang 0.5.23 reserve MiB (its decode-graph term)",
        "capture-plan: whole capture predicted / executor's drop MiB (error)",
        "capture-plan: peak predicted / taken MiB",
    ]
    return [*_table(header, rows), _source(ENGINES, d) + _also("capture-plan's figures", STARTUP_RUN)]


#: vLLM 0.34.0's capture of its own default graphs on an H200 (device_bench's "vllm-0.34" mode)
#: against the plan of the same graphs and vLLM 0.34.0's estimator
ENGINES_034 = "device-2026-12-04-vllm-0.34-full.json"


def engines_034() -> list[str]:
    """vLLM 0.34.0-style capture of its H200 default graphs (its pool and its free-memory drop)
    against the plan of the same graphs (its pool, and its whole-capture figure, a lower bound
    where an item is unknown) and vLLM 0.34.0's two answers: 0 with its extensible KV cache (the
    default on CUDA), else the 2-sample estimate."""
    d = _load(ENGINES_034)
    rows = []
    for case, label in _STARTUP.items():
        v = d["cases"].get(case, {}).get("vllm-0.34")
        if v is None:
            continue
        lower = "" if v["plan_capture_complete"] else " (lower bound)"
        rows.append(
            [
                label,
                str(v["graphs"]),
                f"{_mib(v['vllm_pool_mib'])} / {_mib(v['vllm_capture_drop_mib'])}",
                f"{_mib(v['plan_pool_mib'])} ({_pct(v['plan_pool_error'], 1)})",
                f"{_mib(v['plan_capture_mib'])}{lower}",
                # estimate_extensible_mib is the bench's constant for vLLM's coded answer (0), not a reading
                f"{_mib(v['estimate_extensible_mib'])} (coded, not measured); "
                f"{_mib(v['estimate_mib'])} ({_pct(v['estimate_error'], 0)})",
            ]
        )
    header = [
        "model",
        "vLLM 0.34 graphs",
        "vLLM-0.34-style capture: pool / drop MiB",
        "plan's pool MiB (error against the capture's pool)",
        "plan's whole capture MiB",
        "vLLM 0.34 estimator MiB: extensible KV cache on (vLLM's code returns 0: not measured); "
        "off (error against the drop)",
    ]
    return [*_table(header, rows), _source(ENGINES_034, d)]


#: issue 41's start-up floor: the prediction's time against the capture after it and the capture
#: alone (each mode in a fresh process), and where the prediction's time went
#: the first prediction's cost, before and after its graph copies ran beside the build, again
#: after the review's fixes to those copies (another fresh machine: run-to-run spread), and with
#: a phase's copies made side by side, one thread per recorded graph (executor/graph_nodes.py),
#: then with the capture stream primed in bfloat16 only (and the copies destroyed side by side, since reverted)
STARTUP_FLOOR_RUNS = (
    "device-2026-12-04-startup-floor.json",
    "device-2026-12-04-startup-overlap.json",
    "device-2026-12-04-after-review.json",
    "device-2026-12-04-side-by-side-copies.json",
    "device-2026-12-04-side-by-side-copies-2.json",
    "device-2026-12-04-side-by-side-models.json",
    "device-2026-12-04-bf16-priming.json",
)
#: the runs whose recording is split right into its graphs, warm-ups and the rest: before
#: 8b0d8aa a capture step's seconds left its recording out (executor/step.py)
STARTUP_FLOOR_SPLIT = {
    "device-2026-12-04-side-by-side-copies.json",
    "device-2026-12-04-side-by-side-copies-2.json",
    "device-2026-12-04-side-by-side-models.json",
    "device-2026-12-04-bf16-priming.json",
}


def startup_floor() -> list[str]:
    """Per run and case: steps within 1% or 2 MiB, the prediction's seconds and its parts, the
    capture after it, the capture alone (the "executor" mode, another fresh process), and what
    the prediction added to the start-up (bench/harness.py's ``startup_added``). The copies'
    time is their own thread's where they ran beside the build, with the wait for them after
    it in brackets."""
    startup_added = _bench("harness").startup_added
    rows, sources = [], []
    for name in STARTUP_FLOOR_RUNS:
        d = _load(name)
        sources.append(_source(name, d).strip())
        for case, label in _STARTUP.items():
            row = d["cases"].get(case)
            if row is None:
                continue
            st, ex = row["startup"], row.get("executor")  # a run of the startup mode alone has no capture alone
            parts = st["predict_parts_s"]
            added = startup_added(row)
            waited = parts.get("record.copies.waited")
            copies = f"{parts['record.copies']:.2f}" + (f" ({waited:.2f})" if waited is not None else "")
            split = (
                f"{parts['record.capture.graphs']:.2f} / {parts['record.capture.warmup']:.2f} / "
                f"{parts['record.capture.other']:.2f}"
                if name in STARTUP_FLOOR_SPLIT
                else "(not split right)"
            )
            rows.append(
                [
                    f"{label} (`{d['git_commit'][:7]}`)",
                    st["steps_within_1pct_or_2mib"],
                    f"{st['predict_s']:.2f}",
                    f"{parts['record.capture']:.2f} / {copies} / {parts['build']:.2f}",
                    split,
                    f"{st['capture_s']:.2f}",
                    f"{st['predict_s'] / st['capture_s']:.2f}x",
                    f"{ex['capture_s']:.2f}" if ex else "(not run)",
                    f"{added['added_s']:+.2f} ({added['added_of_capture']:+.2f}x)" if added else "(not run)",
                ]
            )
    header = [
        "model (commit)",
        "steps within 1% or 2 MiB",
        "prediction s",
        "of it: recording / graph copies (waited for) / build s",
        "of the recording: graphs / warm-ups / the rest s",
        "capture after it s",
        "prediction / capture after it",
        "capture alone s",
        "prediction + capture - capture alone s",
    ]
    return [*_table(header, rows), "", *sources]


#: a start-up prediction's graph copies in turn against side by side (bench/copies_bench.py)
COPIES_RUN = "copies-2026-12-04.json"


def copies() -> list[str]:
    """Per case and way: the copies' seconds in each fresh process, their median, and the
    driver memory per phase they took (the same in every process, or each process's)."""
    d = _load(COPIES_RUN)
    rows = []
    for case, label in _STARTUP.items():
        runs = d["cases"].get(case)
        if runs is None:
            continue
        for way, rs in runs.items():
            ok = [r for r in rs if "phases" in r]
            took = {", ".join(f"{n} {_mib(ph['took_bytes'] / 2**20)}" for n, ph in r["phases"].items()) for r in ok}
            rows.append(
                [
                    label,
                    way,
                    " / ".join(f"{r['seconds']:.3f}" for r in ok),
                    f"{statistics.median(r['seconds'] for r in ok):.3f}" if ok else "failed",
                    " | ".join(sorted(took)),
                ]
            )
    header = ["model", "copies", "seconds per process", "median s", "driver memory per phase MiB"]
    return [*_table(header, rows), _source(COPIES_RUN, d)]


#: executable reuse on the H200: every phase set to reuse, before and after the edges' data fix,
#: on transformers models, and with the cluster probe (executor/exec_update.py)
REUSE_RUNS = (
    "device-2026-12-04-reuse.json",
    "device-2026-12-04-reuse-edges.json",
    "device-2026-12-04-reuse-hf.json",
    "device-2026-12-04-reuse-probe.json",
    "device-2026-12-04-after-review.json",
)


def reuse() -> list[str]:
    """Per run and case: graphs, executables, graph-exec memory, verify and wrong replays with
    reuse asked for, the first refusal's reason (every graph was refused in every run) and the
    device's cluster probe verdict."""
    rows, sources = [], []
    for name in REUSE_RUNS:
        d = _load(name)
        sources.append(_source(name, d).strip())
        for case, label in _STARTUP.items():
            r = d["cases"].get(case, {}).get("reuse")
            if r is None:
                continue
            why = r["refusals"][0].split(": ", 1)[1] if r["refusals"] else "none"
            if r.get("clusters"):  # the probe's verdict has a column of its own
                why = why.replace(f"; {r['clusters']}", "")
            rows.append(
                [
                    f"{label} (`{d['git_commit'][:7]}`)",
                    f"{r['instantiations']} / {r['graphs']}",
                    _mib(r["graph_exec_mib"]),
                    f"{'clean' if r['verify_ok'] else 'faults'}, {r['wrong_replays']} wrong",
                    # the bench keeps the first 40 reasons: the count is the graphs in no group
                    f"{r['graphs'] - sum(r['groups'])}: {why}",
                    # runs before the probe existed have no verdict
                    r.get("clusters") or "(no probe)",
                ]
            )
    header = [
        "model (commit)",
        "executables / graphs",
        "graph-exec MiB",
        "verify",
        "refused: first reason",
        "cluster probe",
    ]
    return [*_table(header, rows), "", *sources]


#: replay time per graph (median of 20 after 3 untimed) for three cases, and the timed reports
#: that run wrote beside it (report-CASE-timed-2026-12-04-timing.json: since 8b0d8aa a capture
#: step's seconds count its recording; the 2026-12-02 reports' did not)
TIMING = "device-2026-12-04-timing.json"
TIMED_REPORT = "report-reference-timed-2026-12-04-timing.json"
#: the sizes the replay-times table shows
_TIMED_SIZES = (1, 8, 64, 256)
#: ``planner sizes`` on the reference's measured replay times (the traffic of the README's front)
SIZES_TIMED_ARGS = (
    "sizes",
    "-b",
    "fa3",
    "--ci",
    "--traffic",
    "tests/data/traffic-skewed.csv",
    "--timing",
    f"bench/results/{TIMED_REPORT}",
)


def planner_output(*args: str, env: dict[str, str] | None = None) -> str:
    """What ``planner ARGS`` prints, run from the checkout's root in a fresh process (as a
    user would), with ``env`` set beside this process's environment; exit 1 naming the
    command where it fails."""
    import subprocess

    cmd = [sys.executable, "-c", "import sys; from capture_plan.planner.cli import main; sys.exit(main())", *args]
    full = {**os.environ, **env} if env else None
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False, env=full)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise SystemExit(
            f"docs/generate.py: `planner {' '.join(args)}` exited {done.returncode}: {last}; fix: run that command"
            " from the checkout's root with the package installed (pip install -e .) and mend what it says"
        )
    return done.stdout


def replay_times() -> list[str]:
    d = _load(TIMING)
    rows = []
    for case in ("reference", "llama", "qwen2"):
        ms = {int(k.rsplit("/", 1)[1]): v for k, v in d["cases"][case]["timing"]["replay_ms"].items()}
        rows.append(
            [
                _STARTUP[case],
                str(len(ms)),
                *(f"{ms[n]:.2f}" for n in _TIMED_SIZES),
                f"{min(ms.values()):.2f}-{max(ms.values()):.2f}",
            ]
        )
    header = ["model", "graphs timed", *(f"size {n} ms" for n in _TIMED_SIZES), "min-max ms"]
    out = planner_output(*SIZES_TIMED_ARGS)
    chosen = [line.strip() for line in out.splitlines() if line.strip().startswith(("chosen:", "against "))]
    if not chosen:
        raise SystemExit(
            f"docs/generate.py: `planner {' '.join(SIZES_TIMED_ARGS)}` printed no 'chosen:' line; fix: make"
            " replay_times in docs/generate.py read the lines the command prints now"
        )
    return [
        *_table(header, rows),
        _source(TIMING, d),
        "",
        f"`planner {' '.join(SIZES_TIMED_ARGS)}` (the timed capture report that run wrote for the reference;"
        " step times interpolated between its measured sizes), its choice against the engines' defaults:",
        "",
        "```text",
        *chosen,
        "```",
    ]


def trace_build() -> list[str]:
    name, before_name = "trace-build-2026-12-01-refold.json", "trace-build-2026-12-01-before-refold.json"
    d, before = _load(name), _load(before_name)
    rows = [
        [
            case,
            f"{r['flat_s']:.2f}",
            f"{before['cases'][case]['folded_s']:.2f}",
            f"{r['folded_s']:.2f}",
            "yes" if r["identical"] and before["cases"][case]["identical"] else "NO",
        ]
        for case, r in d["cases"].items()
    ]
    header = [
        "trace",
        "build s, every capture flat",
        "layers folded, each derived size rebuilt and folded",
        "layers folded, derived sizes refolded, fits shared",
        "plans byte-identical",
    ]
    return [*_table(header, rows), _source(name, d) + _also("Before", before_name)]


_ADOPTION = {
    "reference": "reference decode (32 layers)",
    "eagle": "EAGLE's four phases",
    "llama": "Llama (transformers, dense)",
    "mixtral": "Mixtral (MoE)",
    "deepseek_v3": "DeepSeek-V3 (MLA, MoE)",
}


def adoption() -> list[str]:
    name = "adoption-2026-12-01.json"
    d = _load(name)
    rows = []
    for case, label in _ADOPTION.items():
        c = d["cases"][case]
        rows.append(
            [
                label,
                str(c["graphs"]),
                f"{_mib(c['pool_mib']['capture'])} / {_mib(c['pool_mib']['engine_loop'])}",
                ", ".join(k for k, v in c["equal"].items() if v) + (" equal" if all(c["equal"].values()) else ""),
                f"{c['capture_again']['seconds']:.2f} / {c['engine_loop']['seconds']:.2f}",
                f"{c['capture']['verify_faults']} / {c['engine_loop']['verify_faults']}",
            ]
        )
    header = [
        "model",
        "graphs",
        "pool MiB, capture() / engine loop",
        "the same",
        "capture s (warm process) / engine loop s",
        "verify faults",
    ]
    return [*_table(header, rows), _source(name, d)]


_BUILD_ROWS = [
    ("`planner --help`", lambda b: b["help_s"], "-"),
    ("`planner build --backend fa3 --ci`", lambda b: b["build_default_s"], "0.15 s: missed"),
    ("`planner build -b fa3 --ci --speculative eagle`", lambda b: b["build_speculative_s"], "0.4 s: missed"),
    ("4 phases x 35 sizes (in process)", lambda b: b["scale"]["35"], "-"),
    ("4 phases x 128 sizes (in process)", lambda b: b["scale"]["128"], "-"),
    ("4 phases x 512 sizes (in process)", lambda b: b["scale"]["512"], "-"),
    ("4 phases x 1024 sizes (in process)", lambda b: b["scale"]["1024"], "0.5 s: missed"),
    ("4 phases x 2048 sizes", lambda b: b["scale"]["2048"], "-"),
    ("1024 x 4 with `--exact`", lambda b: b["exact_1024_s"], "5 s: missed"),
]


def build() -> list[str]:
    before, now = _load("build-2026-11-29-prev.json"), _load("build-2026-11-29.json")
    rows = [[label, f"{get(before):.2f} s", f"{get(now):.2f} s", target] for label, get, target in _BUILD_ROWS]
    return [
        *_table(["", "before", "now", "target"], rows),
        "",
        f"Source: `bench/results/build-2026-11-29-prev.json` (before, {before['machine']}, median of"
        f" {before['repeat']}, {before['date'][:10]}; {provenance(before)}) and `bench/results/build-2026-11-29.json`"
        f" (now, median of {now['repeat']}; {provenance(now)}).",
    ]


def build_work() -> list[str]:
    name = "build-2026-11-29-work.json"
    d = _load(name)
    w = d["work"]
    rows = [
        [
            label,
            f"{wall:.2f} s",
            f"{w[key]['captures']:,}",
            f"{w[key]['ops']:,}",
            f"{w[key]['simulating_s_at_ns_per_op']} s",
        ]
        for label, key, wall in (
            ("default build", "build_default", d["build_default_s"]),
            ("speculative preset", "build_speculative", d["build_speculative_s"]),
            ("4 phases x 1024 sizes", "scale_1024", d["scale"]["1024"]),
            ("`--exact` 1024 x 4", "exact_1024", d["exact_1024_s"]),
        )
    ]
    return [
        *_table(["build", "wall time", "captures simulated", "allocator operations", "simulating alone"], rows),
        "",
        f"Simulating alone: the operations at the measured {w['ns_per_op']:,} ns per operation. 4 phases x 2048"
        f" sizes: {d['scale']['2048']:.2f} s.",
        _source(name, d) + f" {d['machine']}, median of {d['repeat']}.",
    ]


_CORES_ROWS = [
    ("default", "the default plan (`--backend fa3 --ci`, 36 sizes)", "-"),
    ("eagle", "EAGLE's plan (4 phases)", "0.25x"),
    ("scale_1024", "4 phases x 1024 sizes", "0.25x"),
    ("eagle_trace_3", "EAGLE from a trace of 3 sizes a phase", "0.25x"),
    ("startup_cpu", "a start-up prediction's CPU part (EAGLE: the schedule, then the trace build)", "-"),
]


#: the allocator cores side by side, and the Quickstart build against commit 2a7a316 (issue 31)
BUILD_CORES = "build-2026-12-02-quickstart.json"


def build_cores() -> list[str]:
    name = BUILD_CORES
    d = _load(name)
    cores = d["cores"]
    rows = [
        [
            label,
            f"{cores[key]['python_s']:.2f} s",
            f"{cores[key]['compiled_s']:.2f} s",
            f"{cores[key]['compiled_over_python']:.2f}x",
            target,
            "yes" if cores[key]["identical"] else "NO",
        ]
        for key, label, target in _CORES_ROWS
    ]
    load = f"load average {d['loadavg_before'][0]:.1f} before, {d['loadavg_after'][0]:.1f} after"
    return [
        *_table(["build, in process", "Python core", "compiled core", "ratio", "target", "same plan"], rows),
        "",
        f"Medians of {d['repeat']} runs of each core. 4 phases x 2048 sizes with the compiled core:"
        f" {d['scale']['2048']:.2f} s; simulating the default plan {d['work']['ns_per_op']:,} ns per allocator"
        f" operation with the Python core, {d['work']['ns_per_op_compiled']:,} ns with the compiled one.",
        _source(name, d) + f" {d['machine']}, {load}: a shared machine.",
        "",
        _quickstart(d),
        "",
        *_build_ab("build-2026-12-01-ab.json"),
    ]


def _quickstart(d: dict) -> str:
    """The Quickstart build's whole process against an older installation (--baseline)."""
    q = d["quickstart"]
    ir = (
        f", {q['instructions_over_baseline']:.2f}x the instructions ({q['instructions'] / 1e6:,.0f} M against"
        f" {q['baseline_instructions'] / 1e6:,.0f} M, one run each under valgrind: a count the load does not move)"
        if q.get("instructions_over_baseline")
        else ""
    )
    # how each side was installed (recorded since 2026-12-02; the runs before were editable installs)
    kinds = {q.get("install", "editable"), q.get("baseline_install", "editable")}
    how = {
        frozenset({"installed"}): "both installed with `pip install .` as the Quickstart installs",
        frozenset({"editable"}): "editable installs",
    }.get(frozenset(kinds), f"this one {q.get('install')}, the baseline {q.get('baseline_install')}")
    return (
        f"The Quickstart build (`{q['command']}`, whole processes, each installation's `planner`, {how})"
        f" against commit `{q['baseline_commit'][:7]}`, run alternately {q['repeat']} times each in"
        f" the same run: {q['wall_s']:.3f} s against {q['baseline_wall_s']:.3f} s, {q['wall_over_baseline']:.2f}x"
        f" the wall time (target 0.7x), {q['cpu_over_baseline']:.2f}x the CPU time{ir}."
    )


def _build_ab(name: str) -> list[str]:
    """The whole commands before and after, each installed (``pip install .``), alternating."""
    d = _load(name)
    ab = d["ab"]

    def cell(key: str) -> str:
        return f"{ab[key]['b_over_a_cpu']:.2f}x CPU time, {ab[key]['b_over_a_wall']:.2f}x wall"

    return [
        f"Earlier, when the compiled core came (2026-12-01): whole processes, installed with `pip install .`"
        f" before (the commit that work started from) and"
        f" after, run alternately {d['repeat']} times each (`--python AFTER --against BEFORE`): `planner build"
        f" --backend fa3 --ci --speculative eagle --dry-run` {cell('build_speculative')}, the default build"
        f" {cell('build_default')}, `planner --help` {cell('help')} (unchanged code: the machine's noise).",
        _source(name, d) + f" load average {d['loadavg_before'][0]:.1f} before, {d['loadavg_after'][0]:.1f} after.",
    ]


def startup() -> list[str]:
    name = "startup-2026-11-29-32l.json"
    d = _load(name)
    rows = []
    for plan in sorted(d["plans"]):
        big, small = d["engine_heap"][plan], d["small_heap"][plan]
        rows.append(
            [
                f"{plan} ({d['plans'][plan]['sizes']} sizes)",
                f"{big['executor']['capture_wall_s']:.2f} / {small['executor']['capture_wall_s']:.2f}",
                f"{big['loop']['capture_wall_s']:.2f} / {small['loop']['capture_wall_s']:.2f}",
                f"{big['executor']['release_s']:.2f} / {small['executor']['release_s']:.2f}",
            ]
        )
    header = [
        f"plan (`capture()` wall s, {d['objects']:,} objects / small process)",
        "executor",
        "engines' loop",
        "`release`",
    ]
    return [
        *_table(header, rows),
        "",
        f"A full collection takes {d['full_gc_s']:.2f} s in the large process.",
        _source(name, d),
    ]


def background() -> list[str]:
    name = "startup-2026-11-29-32l.json"
    d = _load(name)
    rows = []
    for plan in sorted(d["background"]):
        b = d["background"][plan]
        t, c = b["throughput"], b["checked"]
        rows.append(
            [
                plan,
                f"{t['first_servable_replay_s']:.3f}",
                f"{t['all_captured_s']:.2f}",
                f"{b['first_vs_foreground'] * 100:.0f}%",
                f"{t['graph_replays_per_s_during']:.0f} / {t['replays_per_s_after']:.0f}",
                f"{c['checked'] - c['not_equal_eager']}/{c['checked']}",
                _mib(t["pool_mib"]),
                f"`{c['verify']}`",
            ]
        )
    header = [
        "plan",
        "first replay by a graph, s after `capture()`",
        "all captured s",
        "first, of the foreground capture",
        "replays/s during / after",
        "replays during equal eager",
        "pool MiB",
        "verify afterwards",
    ]
    return [*_table(header, rows), _source(name, d)]


def hooks() -> list[str]:
    """The engines' hook points (capture_plan.adapters.plugins.hooks.HOOKS)."""
    from capture_plan.adapters.plugins.hooks import HOOKS

    rows = [
        [f"{h.engine} {h.version}", f"`{h.file.split('/', 1)[1]}`", f"`{h.name}`", f"`{h.signature}`", h.role]
        for h in HOOKS
    ]
    return [
        *_table(["release", "file", "name", "signature", "what capture-plan does with it"], rows),
        "",
        "From `capture_plan.adapters.plugins.hooks`; checked against the wheels by `tests/test_engine_contract.py`.",
    ]


def releases() -> list[str]:
    """The engines' releases against every known release's hook rows (bench/engine_releases.py's
    latest result): held, and the broken rows named."""
    name = sorted(p.name for p in RESULTS.glob("engine-releases-*.json"))[-1]
    d = _load(name)
    rows = []
    for r in d["releases"]:
        broken = "; ".join(f"`{b['name']}`" for b in r["broken"]) or "none"
        known = "" if r["known"] else " (not known)"
        rows.append(
            [
                f"{r['engine']} {r['release']}{known}",
                f"{r['engine']} {r['rows_of']}",
                f"{r['held']} of {r['rows']}",
                broken,
            ]
        )
    return [
        *_table(["wheel", "against the hook rows of", "held", "broken rows"], rows),
        "",
        "Read with zipfile + ast from the wheels (`python -m bench.engine_releases`). "
        "docs/ci/engine-releases.yml is an example workflow to copy into a repository's "
        ".github/workflows/, where it runs that daily against the newest wheels; "
        "nothing in this repository runs it.",
        _source(name, d),
    ]


def _bench(name: str):
    """``bench.<name>`` of this checkout, the package imported from its folder by location
    (as tests/bench_modules.py does: the root is not put on ``sys.path``)."""
    import importlib
    import importlib.util

    if "bench" not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            "bench", ROOT / "bench" / "__init__.py", submodule_search_locations=[str(ROOT / "bench")]
        )
        assert spec is not None and spec.loader is not None
        pkg = importlib.util.module_from_spec(spec)
        sys.modules["bench"] = pkg
        spec.loader.exec_module(pkg)
    return importlib.import_module(f"bench.{name}")


def sglang_reserve() -> list[str]:
    """SGLang 0.5.23's graph reserve on an H200 (bench/baselines.py): arithmetic of its code."""
    b = _bench("baselines")
    prefill = b.sglang_prefill_sizes(8192)
    cases = [
        ("TP 1, decode up to 256, breakable prefill graphs (the defaults)", {}),
        ("the same, an MLA backend (DeepSeek-V3)", {"mla": True}),
        ("the same, DeepEP all-to-all", {"deepep": True}),
        ("TP 1, DP attention over 8, decode up to 256", {"attn_dp_size": 8}),
        ("TP 4 (decode up to 512), DP attention over 8", {"decode_max_bs": 512, "attn_dp_size": 8}),
        ("decode-only server (disaggregated), decode up to 256", {"disaggregation_mode": "decode"}),
    ]
    rows = []
    for label, kw in cases:
        kw = {"decode_max_bs": 256, "prefill_sizes": prefill, **kw}
        decode = b.sglang_reserve_mib(**{**kw, "prefill_backend": "disabled"})
        rows.append([label, _mib(decode), _mib(b.sglang_reserve_mib(**kw) - decode), _mib(b.sglang_reserve_mib(**kw))])
    return [
        *_table(["configuration", "decode graphs MiB", "prefill graphs MiB", "reserve MiB"], rows),
        "",
        f"Computed by `bench/baselines.py` from SGLang 0.5.23's `reserve_for_graph_mb` ({len(prefill)} default"
        " prefill sizes up to 8,192 tokens); nothing measured.",
    ]


#: the restore floor runs docs/restore.md quotes (bench/restore_floor.py), oldest first: the lead
#: appends a run's file name once it is committed
RESTORE_FLOOR_RUNS: list[str] = [
    "restore-floor-2026-12-06-phase1.json",
    "restore-floor-2026-12-06-phase1-eagle.json",
    "restore-floor-2026-12-06-phase2.json",
    "restore-floor-2026-12-06-phase2-moved.json",
]


def restore_floor() -> list[str]:
    """Per run and case of bench/restore_floor.py: graphs, nodes, kernel nodes resolved, device
    addresses in kernel arguments per class, TMA-shaped parameters, the clone floor against
    the capture, the graph file's size and the seconds its save took, and (``--rebuild``
    runs) the same-process rebuild's seconds, against the capture's, and the graphs whose
    rebuilt replay was bit-equal to the captured one (``--moved`` runs: also rebuilt onto
    copies of their segments)."""
    if not RESTORE_FLOOR_RUNS:
        return ["Not measured yet: `python -m bench.restore_floor` writes the JSON this table reads."]
    rows, sources = [], []
    for name in RESTORE_FLOOR_RUNS:
        d = _load(name)
        sources.append(_source(name, d).strip())
        run = name.removeprefix("restore-floor-").removesuffix(".json")  # a case measured in several runs
        for case_name, row in d["cases"].items():
            case = f"{case_name} ({run})"
            if "probe" not in row:
                rows.append([case, "failed", *[""] * 8])
                continue
            p, a = row["probe"], row["probe"]["addresses"]
            size = row.get("save", {}).get("bytes")
            save_s = row.get("save", {}).get("seconds")
            rb = row.get("rebuild", {})
            rebuilt = (
                f"{rb['seconds']:.3f} ({rb['of_capture']:.2f}x), {len(rb['equal'])}/{row['graphs']}"
                if "seconds" in rb
                else ("failed" if rb else "")
            )
            mv = row.get("moved", {})
            if mv:  # the relocation proof (--moved)
                moved = f"{len(mv['equal'])}/{row['graphs']}" if "equal" in mv else "failed"
                rebuilt += ("; " if rebuilt else "") + f"onto copies {moved}"
            rows.append(
                [
                    case,
                    f"{p['graphs']} / {p['nodes']:,}",
                    f"{p['names']:,}/{p['kernel_nodes']:,}",
                    f"{a['pool']:,} / {a['torch']:,} / {a['outside']:,}",
                    f"{p['tensor_map_params']:,}",
                    f"{row['floor_s']:.3f} / {row['capture_s']:.3f}",
                    f"{row['floor_of_capture']:.2f}x",
                    "" if size is None else f"{size / MiB:,.1f}",
                    "" if save_s is None else f"{save_s:.2f}",
                    rebuilt,
                ]
            )
    header = [
        "case",
        "graphs / nodes",
        "kernels described",
        "addresses pool / other torch / outside",
        "TMA-shaped params",
        "clone floor / capture s",
        "floor of capture",
        "file MiB",
        "save s",
        "rebuild s (of capture), bit-equal graphs",
    ]
    return [*_table(header, rows), "", *sources]


#: the fresh-process restore runs docs/restore.md quotes (``bench/restore_floor.py --fresh``),
#: oldest first: the lead appends a run's file name once it is committed
RESTORE_FRESH_RUNS: list[str] = [
    "restore-fresh-2026-12-07-phase3-fresh.json",
    "restore-fresh-2026-12-07-ctypes.json",
    "restore-fresh-2026-12-07-compiled.json",
    # llama alone, twice, with the compiled builder (it was refused in the run above)
    "restore-fresh-2026-12-07-compiled-llama-1.json",
    "restore-fresh-2026-12-07-compiled-llama-2.json",
]


def restore_fresh() -> list[str]:
    """Per run and case of ``bench/restore_floor.py --fresh``: the capture and the restore, each
    in a fresh process from the weights loaded to the graphs ready, the restore's parts (its
    loading runs and keys, the rebuild), the restored graphs bit-equal to the eager run, the
    segments relocated, the file's size; a refusal with its first reason."""
    if not RESTORE_FRESH_RUNS:
        return ["Not measured yet: `python -m bench.restore_floor --fresh` writes the JSON this table reads."]
    rows, sources, parts = [], [], []
    for name in RESTORE_FRESH_RUNS:
        d = _load(name)
        sources.append(_source(name, d).strip())
        run = name.removeprefix("restore-fresh-").removesuffix(".json")
        for case_name, row in d["cases"].items():
            c, r = row.get("capture", {}), row.get("restore", {})
            case = f"{case_name} ({run})"
            if "seconds" not in c:
                rows.append([case, c.get("skipped", "capture failed"), *[""] * 6])
                continue
            saved = f"{c['save']['bytes'] / MiB:,.1f}"
            if "seconds" not in r:
                why = f"refused: {r['reasons'][0]}" if "refused" in r else r.get("skipped", "restore failed")
                rows.append([case, f"{c['seconds']:.3f}", why, "", "", "", "", saved])
                continue
            p = r["parts"]
            if "load.eager.first" in p:  # runs that time their parts so
                parts.append(
                    f"- {case}: the first eager run {p['load.eager.first']:.3f} s of {p.get('load', 0.0):.3f} s "
                    f"loading; {c['save'].get('modules', '?')} modules reached at {len(r['keys'])} of "
                    f"{c['graphs']} keys; nodes added in {p.get('rebuild.nodes', 0.0):.3f} s by the "
                    f"{str(r.get('builder', '?')).split(' (')[0]} builder"
                )
            rows.append(
                [
                    case,
                    f"{c['seconds']:.3f}",
                    f"{r['seconds']:.3f}",
                    f"{r['seconds'] / c['seconds']:.2f}x",
                    f"{r['parts'].get('load', 0.0):.3f} ({len(r['keys'])} keys) / {r['parts'].get('rebuild', 0.0):.3f}",
                    f"{len(r['equal'])}/{r['graphs']} (captured {len(c['captured_equal'])}/{c['graphs']})",
                    f"{r['moved']}/{r['segments']}",
                    saved,
                ]
            )
    header = [
        "case",
        "capture s",
        "restore s",
        "of capture",
        "loading runs / rebuild s",
        "bit-equal to eager",
        "segments moved",
        "file MiB",
    ]
    return [*_table(header, rows), "", *sources, *([""] + parts if parts else [])]


# -- planner fit (docs/fit.md) ----------------------------------------------------------------

#: the worked examples' models (planner/data/configs) and the two devices
FIT_MODELS = ("llama-3.1-8b", "qwen2.5-7b", "qwen3-30b-a3b", "deepseek-v2-lite", "gemma-2-9b")
FIT_DEVICES = ("NVIDIA H100 80GB HBM3", "NVIDIA H200")


def fit_rules() -> list[str]:
    """Which release follows which rule: planner/data/fit_rules.toml."""
    from capture_plan.planner.fit.tables import rules, wheels

    rows = []
    for name, r in rules().items():
        if r.engine != "vllm":
            rows.append([f"`{name}`", f"{r.engine} {', '.join(r.releases)}", "static fraction", "-", "-", "-", "-"])
            continue
        when = "after capture (measured)" if r.kind == "vllm-after-capture" else f"estimate {r.graph_estimate}"
        util = f"{r.default_utilization:g}" if r.kind != "vllm-after-capture" else "1.0 (extensible)"
        rows.append(
            [
                f"`{name}`",
                "vllm " + ", ".join(r.releases),
                when,
                util,
                "blocks // groups x block" if r.kv_tokens == "blocks" else "concurrency x max-model-len",
                f"{r.in_flight_batches} x max-num-batched-tokens",
                ", ".join(r.capture_appends) or "none",
            ]
        )
    header = [
        "rule",
        "releases",
        "graph memory",
        "default utilization",
        "tokens logged",
        "sliding window holds",
        "sizes appended",
    ]
    shas = [f"`{k}` {w.sha256[:12]}" for k, w in wheels().items()]
    return _table(header, rows) + ["", "Wheels read (sha256, first 12 digits): " + "; ".join(shas) + "."]


def fit_context() -> list[str]:
    """The longest context each release takes: planner/data/fit_rules.toml [context.NAME]."""
    from capture_plan.planner.fit.tables import context_rules

    rows = []
    for name, r in context_rules().items():
        rows.append(
            [
                f"`{name}`",
                f"{r.engine} " + ", ".join(r.releases),
                f"`--{r.flag}`",
                ("the smallest of " if r.pick == "smallest" else "the first of ")
                + ", ".join(r.keys)
                + (f"; {r.override_key} where given" if r.override_key else ""),
                ", ".join(r.unscaled_rope_types)
                + ("; a row holding original_max_position_embeddings" if r.original_unscaled else "")
                + ("; model types " + ", ".join(r.unscaled_model_types) if r.unscaled_model_types else "")
                + ("; rows nested by layer type" if r.nested_unscaled else ""),
                "yes" if r.yarn_from_original else "no",
                " or ".join(f"`{e}`" for e in r.allow_env),
            ]
        )
    header = [
        "rule",
        "releases",
        "flag",
        "length from the config",
        "factor not applied for",
        "yarn: original x factor",
        "a longer one allowed by",
    ]
    return _table(header, rows)


def fit_examples() -> list[str]:
    """fit's figures for the worked examples: each model on H100 and H200, one release of each rule."""
    from capture_plan.planner.fit.fit import FitRequest, fit
    from capture_plan.planner.fit.model import load_model
    from capture_plan.planner.fit.tables import GiB, rules
    from capture_plan.schemas.errors import InputError

    engines = [f"{r.engine}=={r.releases[0]}" for r in rules().values()]
    rows = []
    for name in FIT_MODELS:
        model = load_model(str(ROOT / "planner/data/configs" / f"{name}.json"))
        for dev in FIT_DEVICES:
            for eng in engines:
                flags = {"context-length" if eng.startswith("sglang") else "max-model-len": 8192}
                short = dev.removeprefix("NVIDIA ").split(" ")[0]
                try:
                    r = fit(FitRequest(model, dev, eng, 1, flags))
                except InputError as err:
                    rows.append([name, short, eng, "refused: " + str(err).split(": ", 1)[-1].split(";")[0]] + [""] * 5)
                    continue
                items = {i.name: i.bytes for i in r.items}
                graph = items.get("graph memory")
                rows.append(
                    [
                        name,
                        short,
                        eng,
                        f"{r.settings.get('gpu-memory-utilization', r.settings.get('mem-fraction-static'))}",
                        f"{items['weights'] / GiB:.2f}",
                        "unknown" if graph is None else f"{graph / GiB:.2f}",
                        f"{r.kv_bytes / GiB:.2f}",
                        f"{r.kv_tokens:,}",
                        f"{r.max_concurrency:.1f}x",
                    ]
                )
    header = [
        "model",
        "device",
        "engine",
        "utilization / fraction",
        "weights GiB",
        "graph GiB",
        "KV GiB",
        "KV tokens",
        "at 8192",
    ]
    return _table(header, rows)


def fit_example() -> list[str]:
    """One whole `planner fit` table, as a user runs it."""
    args = ("fit", "--model", "planner/data/configs/llama-3.1-8b.json", "--device", "H100", "--engine", "vllm==0.34.0")
    out = planner_output(*args, "--max-model-len", "8192")
    return ["```console", f"$ planner {' '.join(args)} --max-model-len 8192", *out.rstrip().splitlines(), "```"]


def fit_calibrated() -> list[str]:
    """`planner fit` with a plan and its calibration: the plan's sizes and pool, the measured graph memory."""
    args = ("fit", "--model", "llama-3-8b", "--device", "H200", "--engine", "vllm==0.34.0", "--max-model-len", "8192")
    files = ("--plan", "plans/fa3-ci-h200.json", "--calibration", "plans/calibration/h200-fa3-ci.json")
    out = planner_output(*args, *files)
    return ["```console", f"$ planner {' '.join(args + files)}", *out.rstrip().splitlines(), "```"]


def fit_traffic() -> list[str]:
    """`planner fit --traffic`: the traffic's front priced in KV tokens beside the engine default's
    (the rows from the KV tokens on: the items above them are fit-example's)."""
    args = ("fit", "--model", "planner/data/configs/llama-3.1-8b.json", "--device", "H100", "--engine", "vllm==0.34.0")
    more = ("--max-model-len", "8192", "--traffic", "tests/data/traffic-skewed.csv")
    lines = planner_output(*args, *more).rstrip().splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("KV tokens "))
    return ["```console", f"$ planner {' '.join(args + more)}", "...", *lines[start:], "```"]


def fit_speculative() -> list[str]:
    """`planner fit` under speculative decoding: Llama-3.1-8B and its EAGLE head on the H100,
    vLLM 0.34.0 and SGLang 0.5.23 (planner/data/fit_rules.toml [speculative]), and which
    releases each speculative rule covers."""
    from capture_plan.planner.fit.tables import spec_rules

    target = ("--model", "planner/data/configs/llama-3.1-8b.json", "--device", "H100")
    draft = "planner/data/configs/eagle-llama-3.1-8b.json"
    vllm_spec = json.dumps({"method": "eagle", "model": draft, "num_speculative_tokens": 3}, separators=(",", ":"))
    # SGLang runs the draft at the target's 8192 tokens, past the 2048 the head's config gives,
    # only under this variable (model_config.py _derive_context_length), as a deployment must
    long_draft = {"SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN": "1"}
    runs = [
        (
            {},
            ("fit", *target, "--engine", "vllm==0.34.0", "--max-model-len", "8192", "--speculative-config", vllm_spec),
        ),
        (
            long_draft,
            ("fit", *target, "--engine", "sglang==0.5.23", "--context-length", "8192", "--speculative-algorithm")
            + ("EAGLE", "--speculative-draft-model-path", draft),
        ),
    ]
    out = ["| rule | releases | methods priced | methods refused |", "|---|---|---|---|"]
    for name, r in spec_rules().items():
        out.append(
            f"| {name} | {r.engine} {', '.join(r.releases)} | {', '.join(r.methods)} | {', '.join(r.unmodelled)} |"
        )
    for name, r in spec_rules().items():
        out += ["", f"{name}, as read from the wheels:", ""] + [f"- {step}" for step in r.sources]
    for env, args in runs:
        text = planner_output(*args, env=env)
        shown = "".join(f"{k}={v} " for k, v in env.items())
        out += ["", "```console", f"$ {shown}planner {shlex.join(args)}", *text.rstrip().splitlines(), "```"]
    return out


def _published_logs():
    """tests/published_logs.py, the one owner of fit's run against the published logs and of what
    it is held to (tests/data/fit_logs.toml), imported by location (tests/ is not a package)."""
    import importlib.util

    if "published_logs" not in sys.modules:
        spec = importlib.util.spec_from_file_location("published_logs", ROOT / "tests" / "published_logs.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["published_logs"] = module
        spec.loader.exec_module(module)
    return sys.modules["published_logs"]


def fit_logs() -> list[str]:
    """fit against each published start-up log (tests/published_logs.py ``compare``, as
    tests/test_fit_logs.py runs it): the figures the log shows, fit's from the log's config,
    device and settings, and fit's error."""
    from capture_plan.planner.fit.model import load_model
    from capture_plan.planner.fit.tables import GiB, rule_for
    from capture_plan.schemas.errors import InputError

    pl = _published_logs()
    rows = []
    for path in pl.fixtures():
        log = pl.read(path)
        head = [
            f"[{path.stem}]({log['url']})",
            log["version"],
            log["device"].removeprefix("NVIDIA "),
            log["model"],
            str(log["tp"]),
        ]
        logged = log["logged"]
        kind = pl.kind(path)
        if kind != "compared":
            try:  # the refusal's own line: the release's, or the model's
                rule_for(f"{log['engine']}=={log['version']}")
                load_model(str(path.parent / log["config"]))
            except InputError as err:
                what = str(err).split(": ", 1)[-1].split(";")[0].split(" (modelled")[0]
                rows.append(head + ["refused: " + what, "", ""])
                continue
        c = pl.compare(path)
        r, shown = c.result, c.logged_graph
        if c.graph is None:  # unknown on this device: the engine's own estimate in its place
            graph_cell = f"unknown ({shown} logged, given)"
        else:
            graph_cell = f"{c.graph / GiB:.2f} / {shown} ({c.graph / GiB / shown - 1:+.0%})"
        tokens = logged.get("kv_tokens")
        rows.append(
            head
            + [
                f"{r.kv_tokens:,} / {tokens:,} ({r.kv_tokens / tokens - 1:+.2%})"
                if tokens
                else f"{r.kv_tokens:,} / not compared",
                graph_cell,
                f"{r.kv_bytes / GiB:.2f} / {logged['kv_cache_gib']}",
            ]
        )
    header = [
        "log",
        "release",
        "device",
        "model",
        "tp",
        "KV tokens: fit / logged",
        "graph GiB: fit / logged",
        "KV GiB: fit / logged",
    ]
    return _table(header, rows)


_FIGURES = {
    "kv_tokens": "KV tokens",
    "kv_cache_gib": "KV GiB",
    "graph": "graph memory",
    "weights": "weights",
    "activation_peak_gib": "activation peak",
}


def fit_log_gaps() -> list[str]:
    """The gaps tests/test_fit_logs.py holds fit to (tests/data/fit_logs.toml), one bullet per
    theme: its figures, logs, recorded errors and bounds, and why; then the refused logs."""
    pl = _published_logs()
    lines = []
    for name, theme in pl.THEMES.items():
        gaps = {key: g for key, g in pl.GAPS.items() if g.theme == name}
        if not gaps:
            continue
        figures = ", ".join(dict.fromkeys(_FIGURES[f] for _, f in gaps))
        errors = sorted(g.error for g in gaps.values())
        span = f"{errors[0]:+.1%}" + (f" to {errors[-1]:+.1%}" if errors[-1] != errors[0] else "")
        bounds = sorted({g.bound for g in gaps.values()})
        logs = len({stem for stem, _ in gaps})
        said = f"{figures} of {logs} log{'s' if logs > 1 else ''}: {span} recorded, held within " + " or ".join(
            f"{b:.1%}" for b in bounds
        )
        lines.append(f"- **{theme['title']}** ({said}): {' '.join(theme['text'].split())}")
    releases = [p.stem for p in pl.fixtures() if pl.kind(p) == "refused-release"]
    models = [f"{stem} (its line names: {'; '.join(names)})" for stem, names in pl.REFUSED.items()]
    lines.append(
        f"- Refused, in one line: {len(releases)} logs of releases fit does not model ({', '.join(releases)}), "
        f"each naming the nearest modelled release; and the models fit does not model: {', '.join(models)}."
    )
    return lines


def _fit_cell(c: dict, tokens: bool = False) -> str:
    """One item of bench/fit_bench.py: the runner's figure / fit's (fit's error; the target met or not)."""
    shown = (lambda v: f"{v:,}") if tokens else (lambda v: _mib(v / MiB))
    if c["fit"] is None:
        return f"{shown(c['runner'])} / unknown (miss)"
    err = "n/a" if c["error"] is None else _pct(c["error"])
    return f"{shown(c['runner'])} / {shown(c['fit'])} ({err}, {'met' if c['ok'] else 'miss'})"


def _newest_fit_runs(names: list[str], release: str) -> dict[str, str]:
    """Each case's newest fit-bench file among ``names`` (sorted) that compares fit with the
    runner for ``release`` (a refit is dated after the run it refits, so it is the newer; of
    runs of one date, the first): case -> file."""
    newest: dict[str, str] = {}
    for name in names:
        for case, by in _load(name)["cases"].items():
            if (by.get(release) or {}).get("compare") and (
                case not in newest or _load(newest[case])["date"] < _load(name)["date"]
            ):
                newest[case] = name
    return newest


def fit_bench() -> list[str]:
    """Per run (bench/results/fit-bench-*.json, oldest first) and case of bench/fit_bench.py:
    each item the engine-faithful runner (vLLM 0.34.0- or 0.33.0-shaped, SGLang 0.5.23-shaped)
    measured against `planner fit`'s figure for the same model, device and settings, and fit's
    rule fed the runner's measured items (a model fit refuses: the runner's figures alone)."""
    runs = sorted(p.name for p in RESULTS.glob("fit-bench-*.json"))
    if not runs:
        return ["Not measured yet: `python -m bench.fit_bench` writes the JSON this table reads."]
    # a refit (`--refit`) is fit re-run over a measured file's runner records: it replaces that
    # file, and a later refit of the same file replaces the earlier one (runs are sorted by date)
    latest = {_load(n)["refit_of"]["file"]: n for n in runs if "refit_of" in _load(n)}
    refitted = set(latest) | {n for n in runs if "refit_of" in _load(n) and n not in latest.values()}
    rows, sources = [], []
    verdict: dict[str, dict[str, list[dict]]] = {}  # release -> item -> its comparisons
    for name in (n for n in runs if n not in refitted):
        d = _load(name)
        source = _source(name, d).strip()
        if "refit_of" in d:
            of = d["refit_of"]
            known = provenance(of)
            source += (
                f" fit re-run at `{(d.get('git_commit') or '?')[:7]}` over the runner's records of "
                f"`bench/results/{of['file']}` (measured at `{(of.get('git_commit') or '?')[:7]}`"
                f"{'; ' + known if known else ''})."
            )
        sources.append(source)
        for case, row, release in ((c, row, r) for c, runs in d["cases"].items() for r, row in runs.items()):
            label = release.replace("==", " ")
            if "compare" not in row:
                rows.append([case, label, "skipped" if "skipped" in row else "failed", *[""] * 5])
                continue
            c, p, r = row["compare"], row["compare_plan"], row["rule_check"]
            if c is None:  # fit refused the model: the runner's KV tokens, fit's rule on its items
                kv = f"{row['runner']['kv_tokens']:,} / refused"
                rule = "n/a" if r["error"] is None else _pct(r["error"], 2)
                rows.append([case, label, "fit refused", "", "", "", kv, rule])
                continue
            for item in ("weights", "activation peak", "graph memory", "kv tokens"):
                verdict.setdefault(label, {}).setdefault(item, []).append(c[item])
            verdict[label].setdefault("rule", []).append(r)
            rows.append(
                [
                    case,
                    label,
                    _fit_cell(c["weights"]),
                    _fit_cell(c["activation peak"]),
                    _fit_cell(c["graph memory"]),
                    "no plan" if p is None else _fit_cell(p["graph memory"]),
                    _fit_cell(c["kv tokens"], tokens=True),
                    "n/a" if r["error"] is None else _pct(r["error"], 2),
                ]
            )
    header = [
        "case",
        "release",
        "weights MiB: runner / fit",
        "activation peak MiB",
        "graph memory MiB",
        "graph memory, fit --plan",
        "KV tokens",
        "fit's rule on the runner's items: blocks error",
    ]
    lines = []
    for label, items in verdict.items():
        parts = []
        for item, cs in items.items():
            errs = [x["error"] for x in cs if x.get("error") is not None]
            digits = 2 if item == "rule" else 1
            span = f"{_pct(min(errs), digits)} to {_pct(max(errs), digits)}" if errs else "n/a"
            if item == "rule":
                parts.append(f"fit's rule on the runner's items {span}")
            else:
                parts.append(f"{item} met in {sum(x['ok'] for x in cs)} of {len(cs)} (fit {span})")
        lines.append(f"- {label}: " + "; ".join(parts) + ".")
    latest = []  # each release's cases at their newest run: where the runners and fit stand now
    for label in verdict:
        release = label.replace(" ", "==")
        newest = _newest_fit_runs([n for n in runs if n not in refitted], release)
        cases = sorted(newest)
        parts = []
        for item in ("weights", "activation peak", "graph memory", "kv tokens"):
            cs = [_load(newest[case])["cases"][case][release]["compare"][item] for case in cases]
            met = [case for case, x in zip(cases, cs) if x["ok"]]
            missed = [case for case in cases if case not in met]
            parts.append(f"{item} met in {len(met)} of {len(cs)}" + (f" (not {', '.join(missed)})" if missed else ""))
        files = sorted(set(newest.values()))
        latest.append(
            f"- {label}, each case's newest run ({', '.join(f'`{f}`' for f in files)}): " + "; ".join(parts) + "."
        )
    return [*_table(header, rows), "", *lines, "", *latest, "", *sources]


def fit_sglang_bench() -> list[str]:
    """The SGLang 0.5.23 rows of bench/fit_bench.py's runs, each case's newest (a refit is
    newer than the run it refits), item by item: what the runner's figures hold that SGLang's
    do not. The runner's graph figure is the capture's free-memory drop: the pool, the shared float32 logits buffer
    and the rest (the decode graphs' execs, the capture stream's workspaces, the allocator's
    reserve); of the pool, the transformers attention's K and V expanded from the KV heads to
    the query heads (SDPA's and eager's ``repeat_kv`` over the case's static decode cache at
    the largest decode size), which SGLang's attention backends do not allocate: counted from
    the case's config and the runner's recorded cache, not measured."""
    from capture_plan.bench.harness import HF_ARCHS

    runs = [
        n
        for n in sorted(p.name for p in RESULTS.glob("fit-bench-*.json"))
        if "sglang==0.5.23" in _load(n).get("releases", {})
    ]
    if not runs:
        return [
            "Not measured yet: `python -m bench.fit_bench --releases sglang==0.5.23` writes the JSON this table reads."
        ]
    # each case's newest run: a run may hold some cases
    newest = {c: n for c, n in _newest_fit_runs(runs, "sglang==0.5.23").items() if c in HF_ARCHS}
    rows = []
    for case in sorted(newest):
        d = _load(newest[case])
        # runs whose runner attends with FA3 (its DIFFERS says so: bench/fit_bench_sglang.py) expand nothing
        fa3 = any("attend with FA3" in x for x in d.get("differs_sglang", []))
        row = d["cases"][case]["sglang==0.5.23"]
        r, c, m = row["runner"], row["compare"], row["runner"]["measured"]
        kw = HF_ARCHS[case][1]
        heads, kv = kw["num_attention_heads"], kw["num_key_value_heads"]
        per_token, layers = m["kv_bytes_per_token_layer"], m["layers"]["full"] + m["layers"]["sliding"]
        tokens = m["committed_bytes"] // (per_token * layers)  # requests x cache length
        expanded = heads // kv * per_token * tokens if heads != kv and not fa3 else 0
        rest = r["graph_bytes"] - r["graph_pool_bytes"] - m["logits_buffer_bytes"]
        grew = m.get("capture_reserved_growth_bytes")  # runs since the runner split the drop
        split = (
            ""
            if grew is None
            else f" (torch {_mib((grew - r['graph_pool_bytes'] - m['logits_buffer_bytes']) / MiB)}"
            f" + driver {_mib((r['graph_bytes'] - grew) / MiB)})"
        )
        rows.append(
            [
                case,
                _fit_cell(c["weights"]),
                _fit_cell(c["activation peak"]),
                f"{_mib(r['graph_bytes'] / MiB)} = {_mib(r['graph_pool_bytes'] / MiB)} + "
                f"{_mib(m['logits_buffer_bytes'] / MiB)} + {_mib(rest / MiB)}{split}",
                _mib(expanded / MiB),
                f"{_mib(c['graph memory']['fit'] / MiB)} ({_pct(c['graph memory']['error'])})",
            ]
        )
    header = [
        "case",
        "weights MiB: runner / fit",
        "activation peak MiB: runner / fit",
        "runner's graph MiB = pool + logits buffer + rest",
        "of the pool: transformers' K/V expansion MiB (none under FA3)",
        "fit's graph MiB",
    ]
    sources = []
    for name in sorted(set(newest.values())):
        d = _load(name)
        of = d.get("refit_of")
        refit = (
            f" fit re-run at `{(d.get('git_commit') or '?')[:7]}` over the runner's records of `{of['file']}`."
            if of
            else ""
        )
        sources.append(_source(name, d) + refit)
    return [*_table(header, rows), *sources]


TABLES = {
    "capture": capture,
    "speculative": speculative,
    "bugs": bugs,
    "models": models,
    "device": device,
    "startup-prediction": startup_prediction,
    "startup-time": startup_time,
    "startup-cached": startup_cached,
    "trace-build": trace_build,
    "adoption": adoption,
    "build": build,
    "build-work": build_work,
    "build-cores": build_cores,
    "startup": startup,
    "background": background,
    "sglang-reserve": sglang_reserve,
    "engines": engines,
    "engines-034": engines_034,
    "startup-floor": startup_floor,
    "copies": copies,
    "reuse": reuse,
    "replay-times": replay_times,
    "hooks": hooks,
    "releases": releases,
    "restore-floor": restore_floor,
    "restore-fresh": restore_fresh,
    "fit-rules": fit_rules,
    "fit-context": fit_context,
    "fit-examples": fit_examples,
    "fit-example": fit_example,
    "fit-calibrated": fit_calibrated,
    "fit-traffic": fit_traffic,
    "fit-speculative": fit_speculative,
    "fit-logs": fit_logs,
    "fit-log-gaps": fit_log_gaps,
    "fit-bench": fit_bench,
    "fit-sglang-bench": fit_sglang_bench,
}


# -- figures quoted in prose ---------------------------------------------------------------

#: an inline figure: ``<!-- fig: NAME -->text<!-- /fig -->``, or ``<!-- fig: source FILE -->``
FIG = re.compile(r"<!-- fig: (?P<name>[a-z0-9-]+)(?: (?P<arg>[\w.-]+\.json))? -->(?P<body>.*?)<!-- /fig -->", re.S)
_WORDS = ("no", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
#: the start-up cases' short names, in prose
_SHORT = {
    "reference": "the reference",
    "llama": "Llama",
    "gemma2": "Gemma2",
    "qwen2": "Qwen2",
    "mixtral": "Mixtral",
    "qwen2_moe": "Qwen2-MoE",
    "eagle": "EAGLE",
}


class Figure(NamedTuple):
    """A figure quoted in prose: the result files it reads (``bench/results/``), and the
    function that renders it from their contents, in that order."""

    files: tuple[str, ...]
    render: Callable[..., str]


FIGURES: dict[str, Figure] = {}


def figure(name: str, *files: str) -> Callable[[Callable[..., str]], Callable[..., str]]:
    """Register ``name``'s renderer, which reads ``files``."""

    def register(fn: Callable[..., str]) -> Callable[..., str]:
        FIGURES[name] = Figure(files, fn)
        return fn

    return register


def _word(n: int) -> str:
    return _WORDS[n] if n < len(_WORDS) else str(n)


def _and(names: list[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def _span(values: list[float], fmt: str, sep: str = "-") -> str:
    lo, hi = min(values), max(values)
    return format(lo, fmt) if format(lo, fmt) == format(hi, fmt) else f"{format(lo, fmt)}{sep}{format(hi, fmt)}"


def source_figure(name: str) -> str:
    """``source FILE``: the file's path, and how its code is known where not a clean commit."""
    known = provenance(_load(name))
    return f"`bench/results/{name}`" + (f", {known}" if known else "")


#: the capture bench's last run (it replaced capture-2026-11-29-32l.json, whose report report-fa3-ci.json is)
CAPTURE = "capture-2026-12-02-32l.json"
#: the capture bench's run before it, kept for the capture times' spread between runs
CAPTURE_BEFORE = "capture-2026-11-29-32l.json"
COLD = "cold-stream-2026-11-29.json"
SPECULATIVE = "speculative-2026-11-29-32l.json"
SPECULATIVE_TIMING = "speculative-2026-11-29-32l-timing.json"
#: the per-step reports of the two EAGLE captures of SPECULATIVE's run (the plain plan, the CI plan)
EAGLE_REPORTS = ("report-fa3-eagle.json", "report-fa3-eagle-ci.json")
ALLOCATOR = "allocator-diff-2026-11-29.json"
STARTUP_BENCH = "startup-2026-11-29-32l.json"
BUILD_WORK = "build-2026-11-29-work.json"
BUILD_INSTALLED = "build-2026-11-29-installed.json"
MODELS = "models-2026-11-29.json"
BUILD_PROGRAMS = (
    "build-2026-11-29-programs-ab.json",
    "build-2026-11-29-programs-ba.json",
    "build-2026-11-29-programs-default-base-vs-new.json",
    "build-2026-11-29-programs-default-new-vs-base.json",
)
#: the targets the figures are read against (the issues' targets, not measurements): a build's
#: wall time (s), the large process's capture over the small one's, the capture-time ratio of
#: the EAGLE plans to the loop
TARGETS = {"build_speculative": 0.4, "scale_1024": 0.5, "heap_vs_small": 1.1}


class PathFigure(NamedTuple):
    """A figure that is one value (or one object) of one file, formatted: ``path`` is
    ``/``-separated keys (list indices as numbers; empty: the whole file), ``template`` a
    :meth:`str.format` string given the value (an object's fields by name: ``{a[b]}``),
    after dividing a number by ``scale``."""

    name: str
    file: str
    path: str
    template: str
    scale: float = 1


#: figures read straight from one file; the ones that compute across values are @figure below
PATH_FIGURES: tuple[PathFigure, ...] = (
    PathFigure("capture-executor-pool", CAPTURE, "executor/pool_mib", "{:,.0f} MiB"),
    PathFigure("capture-loop-pool", CAPTURE, "sglang/pool_mib", "{:,.0f} MiB"),
    PathFigure("capture-analytic", CAPTURE, "executor/predicted_analytic_mib", "{:,.0f} MiB"),
    PathFigure(
        "replay-overhead",
        CAPTURE,
        "replay_overhead",
        "{overhead_us:.2f} µs over a bare `CUDAGraph.replay()` ({graphset_us:.2f} against {bare_us:.2f} µs "
        "per call, tiny graph, median of {repeats} × {calls})",
    ),
    PathFigure(
        "capture-times",
        CAPTURE,
        "",
        "the loop took {sglang[capture_s]:.2f} s, the executor {executor[capture_s]:.2f} s",
    ),
    PathFigure(
        "capture-times-before",
        CAPTURE_BEFORE,
        "",
        "{sglang[capture_s]:.2f} s and {executor[capture_s]:.2f} s",
    ),
    PathFigure("cold-workspace", COLD, "cold_stream/persistent_blocks/0", "{:,.0f} MiB", MiB),
    PathFigure("cold-pools", COLD, "", "{warm_stream[pool_mib]:,.0f} → {cold_stream[pool_mib]:,.0f} MiB"),
    PathFigure(
        "allocator-match",
        ALLOCATOR,
        "",
        "{programs_per_mode:,} random alloc/free programs per allocator mode captured into private pools on the "
        "H200 and replayed through `PoolSim`: native {modes[native][matches]:,}/{modes[native][programs]:,} and "
        "expandable segments {modes[expandable][matches]:,}/{modes[expandable][programs]:,} match in reserved "
        "bytes, segment sizes and block layout ({seconds:.0f} s)",
    ),
    PathFigure(
        "build-installed",
        BUILD_INSTALLED,
        "",
        "median of {repeat}, a few minutes later): the default build {build_default_s:.2f} s, the speculative "
        "preset {build_speculative_s:.2f} s",
    ),
    PathFigure(
        "build-captures",
        BUILD_WORK,
        "work",
        "the speculative preset simulates {build_speculative[captures]:,} captures, a `1024 x 4` build "
        "{scale_1024[captures]:,}",
    ),
    PathFigure("build-exact-captures", BUILD_WORK, "work/exact_1024/captures", "{:,}"),
    PathFigure("startup-cpu-s", BUILD_CORES, "cores/startup_cpu/compiled_s", "{:.2f} s"),
    PathFigure("startup-cpu-ratio", BUILD_CORES, "cores/startup_cpu/compiled_over_python", "{:.2f}x"),
    PathFigure(
        "quickstart-ratio",
        BUILD_CORES,
        "quickstart",
        "{wall_over_baseline:.2f}x the wall time ({cpu_over_baseline:.2f}x the CPU time)",
    ),
    PathFigure("build-ns-per-op", BUILD_WORK, "work/ns_per_op", "{:.1f} µs", 1000),
    PathFigure("eagle-build-s", STARTUP_RUN, "cases/eagle/build_s", "{:.2f} s"),
    PathFigure("moe-predicted", MODELS, "archs/qwen2_moe/executor/predicted_mib", "{:.1f} MiB"),
)


def _at(data, path: str):
    """The value at ``path`` (PathFigure's), or LookupError saying where the path stops."""
    walked = []
    for key in filter(None, path.split("/")):
        at = "/".join(walked) or "the top"
        if isinstance(data, list):
            if not key.isdigit() or int(key) >= len(data):
                raise LookupError(f"{at} is a list of {len(data)}, which has no item {key!r}")
            data = data[int(key)]
        elif isinstance(data, dict):
            if key not in data:
                raise LookupError(f"{at} has no key {key!r}")
            data = data[key]
        else:
            raise LookupError(f"{at} is a {type(data).__name__} ({data!r}), not an object with {key!r}")
        walked.append(key)
    return data


def _path_render(f: PathFigure) -> Callable[[dict], str]:
    def render(d: dict) -> str:
        where = f"figure {f.name}: bench/results/{f.file}"
        try:
            value = _at(d, f.path)
        except LookupError as err:
            raise SystemExit(
                f"{where} has no {f.path!r} ({err}); fix: point the row of PATH_FIGURES in docs/generate.py "
                "at a value the file holds"
            ) from None
        try:
            if isinstance(value, dict):
                return f.template.format(**value)
            return f.template.format(value / f.scale if f.scale != 1 else value)
        except (LookupError, ValueError, TypeError, AttributeError) as err:
            shown = "an object" if isinstance(value, dict) else f"a {type(value).__name__}"
            raise SystemExit(
                f"{where}: the template {f.template!r} does not fit the value at {f.path or '(the whole file)'!r}, "
                f"{shown} ({type(err).__name__}: {err}); fix: make the row's template in PATH_FIGURES in "
                "docs/generate.py name the fields the value has"
            ) from None

    return render


for _f in PATH_FIGURES:
    FIGURES[_f.name] = Figure((_f.file,), _path_render(_f))


@figure("spec-capture-ratio", SPECULATIVE)
def _spec_capture_ratio(d: dict) -> str:
    loop = d["loop"]["capture_s"]
    ci, plain = (d[p]["capture_s"] / loop for p in ("fa3-eagle-ci.json", "fa3-eagle.json"))
    return f"{ci:.2f}x (CI plan) and {plain:.2f}x (plain plan)"


@figure("spec-timing", SPECULATIVE_TIMING)
def _spec_timing(d: dict) -> str:
    t = d["timing"]
    med, ratio = t["median_s"], t["ratio_to_loop"]
    return (
        f"medians loop {med['loop']:.2f} s, gate {med['gate']:.2f} s, executor {med['fa3-eagle-ci.json']:.2f} s "
        f"(CI plan, {ratio['fa3-eagle-ci.json']:.2f}x) and {med['fa3-eagle.json']:.2f} s "
        f"(plain plan, {ratio['fa3-eagle.json']:.2f}x)"
    )


@figure("spec-bimodal", SPECULATIVE_TIMING)
def _spec_bimodal(d: dict) -> str:
    runs = sorted(x for p in ("fa3-eagle-ci.json", "fa3-eagle.json") for x in d["timing"]["runs_s"][p])
    gap = max(range(1, len(runs)), key=lambda i: runs[i] - runs[i - 1])  # the two modes split at the widest gap
    fast, slow = runs[:gap], runs[gap:]
    return f"{_word(len(runs))} runs are bimodal, {_span(fast, '.2f')} s or {_span(slow, '.2f')} s"


@figure("spec-slow-steps", *EAGLE_REPORTS)
def _spec_slow_steps(plain: dict, ci: dict) -> str:
    import statistics

    times = [{s["id"]: s["seconds"] for s in r["steps"] if s["id"].startswith("capture/")} for r in (plain, ci)]
    slow, fast = sorted(times, key=lambda t: sum(t.values()), reverse=True)
    ratios = [slow[k] / fast[k] for k in slow if k in fast]
    deciles = statistics.quantiles(ratios, n=10)
    return (
        f"per capture step a median {statistics.median(ratios):.1f}x slower, 10th-90th percentile "
        f"{deciles[0]:.1f}-{deciles[-1]:.1f}x"
    )


@figure("spec-verify-pool-error", SPECULATIVE)
def _spec_verify_pool_error(d: dict) -> str:
    pool = d["fa3-eagle.json"]["pools"]["phase:target_verify"]
    return f"{_pct(pool['predicted_mib'] / pool['measured_mib'] - 1)} off"


@figure("startup-bench-heap", STARTUP_BENCH)
def _startup_bench_heap(d: dict) -> str:
    ratios = [r[k] for r in d["ratios"].values() for k in ("executor_heap_vs_small", "loop_heap_vs_small")]
    held = "within" if max(ratios) <= TARGETS["heap_vs_small"] else "not within"
    return f"{_span(ratios, '.2f', ' to ')}x the small process's time: {held} the target of {TARGETS['heap_vs_small']}x"


def _per_op(d: dict, case: str) -> str:
    w = d["work"][case]
    return f"{TARGETS[case] / w['ops'] * 1e9:,.0f} ns"


@figure("build-op-targets", BUILD_WORK)
def _build_op_targets(d: dict) -> str:
    return (
        f"under {_per_op(d, 'build_speculative')} (speculative preset, {TARGETS['build_speculative']} s, before the "
        f"process's start-up and imports) and under {_per_op(d, 'scale_1024')} (`1024 x 4`, "
        f"{TARGETS['scale_1024']} s, of which the chosen plan's own exact simulation is {1024 * 4:,} of the "
        f"{d['work']['scale_1024']['captures']:,} captures)"
    )


@figure("build-ops-per-capture", BUILD_WORK)
def _build_ops_per_capture(d: dict) -> str:
    w = d["work"]
    per = [c["ops"] / c["captures"] for k, c in w.items() if isinstance(c, dict)]
    return f"{_span(per, '.0f', ' to ')} of them on average"


@figure("build-default-work", BUILD_WORK)
def _build_default_work(d: dict) -> str:
    w = d["work"]
    return (
        f"{w['build_default']['simulating_s_at_ns_per_op'] * 1000:.0f} ms simulating "
        f"{w['build_default']['captures']} captures (at {w['ns_per_op'] / 1000:.1f} µs per allocation or free)"
    )


@figure("build-programs", *BUILD_PROGRAMS)
def _build_programs(*runs: dict) -> str:
    default = [r["ab"]["build_default"]["b_over_a_wall"] for r in runs]
    spec = [r["ab"]["build_speculative"]["b_over_a_wall"] for r in runs if "build_speculative" in r["ab"]]
    reps = sorted({r["repeat"] for r in runs})
    return (
        f"{_and([str(n) for n in reps])} runs per side) give `b`-over-`a` wall-time medians of "
        f"{_and([f'{x:.2f}' for x in default])} for the default build and {_and([f'{x:.2f}' for x in spec])} "
        "for the speculative preset"
    )


@figure("prediction-misses", STARTUP_RUN)
def _prediction_misses(d: dict) -> str:
    off = {k: c["startup"]["final_error_mib"] for k, c in d["cases"].items()}
    low = {k: -v for k, v in off.items() if v < 0}
    slack = [
        s["slack_mib"] - (s["measured_peak_mib"] - s["measured_drop_mib"])
        for s in (c["startup"] for c in d["cases"].values())
    ]
    margin = {c["startup"]["margin_mib"] for c in d["cases"].values()}
    groups: dict[float, list[str]] = {}
    for k, v in low.items():
        groups.setdefault(v, []).append(_SHORT[k])
    said = "; ".join(f"{v:.0f} MiB low for {_and(names)}" for v, names in sorted(groups.items()))
    exact = [_SHORT[k] for k, v in off.items() if v == 0]
    return (
        f"after capture {said}"
        + (f", exact for {_and(exact)}" if exact else "")
        + f"; the slack at the peak is {_span(slack, '+.0f', ' to ')} MiB of a {max(margin):.0f} MiB margin"
    )


@figure("eagle-predict", STARTUP_RUN, STARTUP_BEFORE, "device-2026-12-01-startup-eagle.json")
def _eagle_predict(final: dict, before: dict, session: dict) -> str:
    s = [r["cases"]["eagle"]["startup"]["predict_s"] for r in (final, before, session)]
    return f"{s[0]:.1f} s against {s[1]:.1f} s before (its 51-size draft phases recorded whole) and {s[2]:.1f} s"


@figure("earlier-startup", "device-2026-12-01-startup.json")
def _earlier_startup(d: dict) -> str:
    c = d["cases"]
    ref, llama = c["reference"]["startup"], c["llama"]["startup"]
    return (
        f"the reference {_mib(ref['pending_mib'])} MiB predicted for {_mib(ref['measured_drop_mib'])} taken "
        f"({_pct(ref['error'])}), Llama {_mib(llama['pending_mib'])} for {_mib(llama['measured_drop_mib'])}, "
        f"EAGLE's peak {_pct(c['eagle']['startup']['error'])}"
    )


#: four runs of the same start-up cases, three of 2026-12-01 and the last (the capture times'
#: spread between runs)
STARTUP_SPREAD = (
    "device-2026-12-01-startup-timed.json",
    "device-2026-12-01-startup-final.json",
    "device-2026-12-01-startup-spare.json",
    STARTUP_RUN,
)
TRACE_BUILDS = ("trace-build-2026-12-01-before-refold.json", "trace-build-2026-12-01-refold.json")
_TRANSFORMERS = ("llama", "gemma2", "qwen2", "mixtral")


@figure("analytic-config-error", STARTUP_RUN)
def _analytic_config_error(d: dict) -> str:
    errs = {k: c["executor"]["analytic_error"] for k, c in d["cases"].items()}
    hf = [errs[k] * 100 for k in _TRANSFORMERS]
    return (
        f"{max(hf):+.0f}% to {min(hf):+.0f}% off for the transformers models "
        f"({_pct(errs['qwen2_moe'], 0)} for Qwen2-MoE)"
    )


def _decode(d: dict) -> list[dict]:
    return [c for k, c in d["cases"].items() if k != "eagle"]


@figure("predict-fresh", STARTUP_RUN)
def _predict_fresh(d: dict) -> str:
    shares = [c["startup"]["predict_s"] / c["executor"]["capture_s"] * 100 for c in _decode(d)]
    return f"{_span(shares, '.0f', '% to ')}% of the `executor` mode's capture in a fresh process"


@figure("predict-floor", STARTUP_RUN)
def _predict_floor(d: dict) -> str:
    cases = _decode(d)
    parts = [c["startup"]["predict_parts_s"] for c in cases]
    floor = [(p["record.capture"] + p["record.copies"]) / c["startup"]["capture_s"] * 100 for p, c in zip(parts, cases)]
    return (
        f"{_span(floor, '.0f', '% to ')}% of the capture here, before the build from the trace "
        f"({_span([p['build'] for p in parts], '.2f', ' to ')} s here)"
    )


@figure("capture-spread", *STARTUP_SPREAD)
def _capture_spread(*runs: dict) -> str:
    spread = {}
    for k in runs[0]["cases"]:
        times = [r["cases"][k]["startup"]["capture_s"] for r in runs]
        spread[k] = (min(times), max(times))
    worst = max(spread, key=lambda k: spread[k][1] / spread[k][0])
    lo, hi = spread["mixtral"]
    return (
        f"by up to {(spread[worst][1] / spread[worst][0] - 1) * 100:.0f}% between runs and processes "
        f"({_SHORT[worst]}; Mixtral's took {lo:.2f} to {hi:.2f} s"
    )


@figure("cached-first-share", STARTUP_CACHED)
def _cached_first_share(d: dict) -> str:
    share = {k: c["startup"]["predict_s"] / c["startup"]["capture_s"] * 100 for k, c in d["cases"].items()}
    decode = [v for k, v in share.items() if k != "eagle"]
    return (
        f"{_span(decode, '.0f', '% to ')}% of the capture for the decode plans in this run, "
        f"{share['eagle']:.0f}% for EAGLE"
    )


@figure("cached-read-ms", STARTUP_CACHED)
def _cached_read_ms(d: dict) -> str:
    return (
        _span([c["startup-cached"]["predict_parts_s"]["cache"] * 1000 for c in d["cases"].values()], ".0f", " to ")
        + " ms"
    )


@figure("moe-pool", MODELS)
def _moe_pool(d: dict) -> str:
    a = d["archs"]["qwen2_moe"]
    pool, alone = a["executor"]["pool_mib"], a["alone_mib"]
    return (
        f"{a['ratios']['executor_vs_alone']:.2f}x its largest graph alone with the native allocator "
        f"({_mib(pool - alone)} MiB of small-pool segment on a {_mib(alone)} MiB graph)"
    )


@figure("moe-expandable", MODELS)
def _moe_expandable(d: dict) -> str:
    a = d["archs"]["qwen2_moe@expandable"]
    return f"{_mib(a['executor']['pool_mib'])} MiB, {a['ratios']['executor_vs_alone']:.2f}x"


@figure("trace-build-spread", *TRACE_BUILDS)
def _trace_build_spread(*runs: dict) -> str:
    times = [r["cases"]["fa3-ci, every size"]["folded_s"] for r in runs]
    return (
        f"by up to {(max(times) / min(times) - 1) * 100:.0f}% between runs: the every-size fa3-ci row, where "
        f"nothing is derived and the last change does nothing, measured {_and([f'{t:.2f}' for t in sorted(times)])} s"
    )


@figure("schedule-build-s", STARTUP_RUN)
def _schedule_build_s(d: dict) -> str:
    decode = [c["build_s"] for k, c in d["cases"].items() if k != "eagle"]
    return (
        f"{_span(decode, '.2f', ' to ')} s for a decode plan, {d['cases']['eagle']['build_s']:.2f} s for EAGLE's"
        " four phases"
    )


@figure("startup-steps", STARTUP_RUN)
def _startup_steps(d: dict) -> str:
    rows = [c["startup"]["steps_within_1pct_or_2mib"].split("/") for c in d["cases"].values()]
    full = sum(a == b for a, b in rows)
    every = "after every step" + ("" if full == len(rows) else f" for {_word(full)} of the {_word(len(rows))} models")
    return f"within 1% or 2 MiB of the prediction {every}"


@figure("extrapolation-error", EXTRAPOLATION)
def _extrapolation_error(d: dict) -> str:
    errors = [c["vllm"]["error"] for c in d["cases"].values()]
    return f"{min(errors) * 100:+,.0f}% to {max(errors) * 100:+,.0f}%"


def _share(d: dict, eagle: bool) -> list[float]:
    return [
        c["startup"]["predict_s"] / c["startup"]["capture_s"] for k, c in d["cases"].items() if (k == "eagle") == eagle
    ]


@figure("startup-share-decode", STARTUP_RUN)
def _startup_share_decode(d: dict) -> str:
    return _span([x * 100 for x in _share(d, False)], ".0f") + "%"


def _eagle_share(d: dict) -> str:
    return f"{_share(d, True)[0]:.1f}x"


# EAGLE's prediction over its capture, in the last run and at the session's start
for _name, _file in (("startup-share-eagle", STARTUP_RUN), ("startup-share-eagle-before", STARTUP_BEFORE)):
    FIGURES[_name] = Figure((_file,), _eagle_share)
# the same figures from the newest clean run, for the README
FIGURES["latest-steps"] = Figure((STARTUP_LATEST,), _startup_steps)
FIGURES["latest-share-decode"] = Figure((STARTUP_LATEST,), _startup_share_decode)
# two decimals: EAGLE's target is 0.4x, which one decimal would round 0.43x to
FIGURES["latest-share-eagle"] = Figure((STARTUP_LATEST,), lambda d: f"{_share(d, True)[0]:.2f}x")


@figure("cached-predict-s", STARTUP_CACHED)
def _cached_predict_s(d: dict) -> str:
    return _span([c["startup-cached"]["predict_s"] for c in d["cases"].values()], ".3f") + " s"


@figure("cached-share", STARTUP_CACHED)
def _cached_share(d: dict) -> str:
    later = [c["startup-cached"] for c in d["cases"].values()]
    return _span([s["predict_s"] / s["capture_s"] * 100 for s in later], ".1f") + "%"


@figure("cached-peak", STARTUP_CACHED)
def _cached_peak(d: dict) -> str:
    """The later start-up's peak, predicted against taken: within 2 MiB, or how far low/high."""
    off = {
        k: c["startup-cached"]["pending_mib"] - c["startup-cached"]["measured_peak_mib"] for k, c in d["cases"].items()
    }
    within = [k for k, v in off.items() if round(abs(v)) <= 2]  # whole MiB, as the table shows
    share = "all" if len(within) == len(off) else f"{_word(len(within))} of the"
    parts = [f"within 2 MiB for {share} {_word(len(off))} models"]
    for side, sign in (("low", -1), ("high", 1)):
        miss = [k for k, v in off.items() if round(abs(v)) > 2 and v * sign > 0]
        if miss:
            worst = max(abs(off[k]) for k in miss)
            parts.append(
                f"{'' if len(miss) == 1 else 'up to '}{worst:.0f} MiB {side} for {_and([_SHORT[k] for k in miss])}"
            )
    return " and ".join(parts)


def _between(steps: list, name: str) -> tuple[list[float], list[float], int]:
    """A start-up's steps: how far each was predicted high, low, and how many took more than
    predicted beyond 1% or 2 MiB."""
    high = [p - m for _, p, m, *_ in steps if p > m]
    low = [m - p for _, p, m, *_ in steps if m > p]
    above = sum(m - p > max(2, 0.01 * m) for _, p, m, *_ in steps)
    return high, low, above


@figure("cached-between", STARTUP_CACHED)
def _cached_between(d: dict) -> str:
    high, low, above, where = [], [], 0, []
    for k, c in d["cases"].items():
        h, lo, a = _between(c["startup-cached"]["steps"], k)
        high += h
        low += lo
        above += a
        where += [_SHORT[k]] * bool(a)
    return (
        f"predicted high at {len(high)} steps, by up to {max(high, default=0):.0f} MiB, and low at {len(low)},"
        f" by up to {max(low, default=0):.0f} MiB; {above} took more than predicted beyond 1% or 2 MiB"
        + (f" ({_and(where)})" if where else "")
    )


@figure("cached-misses", STARTUP_CACHED)
def _cached_misses(d: dict) -> str:
    """The later start-up's steps outside 1% or 2 MiB: how many, on which side, by how much."""
    off = {
        k: [p - m for _, p, m, *_ in c["startup-cached"]["steps"] if abs(p - m) > max(2, 0.01 * m)]
        for k, c in d["cases"].items()
    }
    misses = [x for v in off.values() for x in v]
    if not misses:
        return "no step outside 1% or 2 MiB"
    side = "all predicted high" if min(misses) > 0 else ("all predicted low" if max(misses) < 0 else "off both ways")
    where = _and([f"{_SHORT[k]} {len(v)}" for k, v in off.items() if v])
    by = _span([abs(x) for x in misses], ".0f")
    return f"{len(misses)} steps outside 1% or 2 MiB ({where}) were {side}, by {by} MiB"


@figure("timed-steps", STARTUP_BEFORE)
def _timed_steps(d: dict) -> str:
    rows = {k: c["startup"] for k, c in d["cases"].items()}
    full = [
        k
        for k, s in rows.items()
        if s["steps_within_1pct_or_2mib"].split("/")[0] == s["steps_within_1pct_or_2mib"].split("/")[1]
    ]
    parts = []
    for k, s in rows.items():
        if k in full:
            continue
        high, low, _ = _between(s["steps"], k)
        miss = [x for x in high + low if x > 2]
        side = "high" if len(high) >= len(low) else "low"
        parts.append(
            f"{_SHORT[k]}: {s['steps_within_1pct_or_2mib']} steps within, the others up to {max(miss):.0f} MiB {side}"
        )
    return f"{_word(len(full))} of {_word(len(rows))} models within 1% or 2 MiB at every step; " + "; ".join(parts)


@figure("vllm-estimate-error", ENGINES)
def _vllm_estimate_error(d: dict) -> str:
    errors = [c["vllm"]["error"] for c in d["cases"].values()]
    high = sum(e > 0 for e in errors)
    side = {len(errors): "high for every model", 0: "low for every model"}.get(
        high, f"high for {_word(high)}, low for {_word(len(errors) - high)} of the models"
    )
    return f"{min(errors) * 100:+.0f}% to {max(errors) * 100:+.0f}% ({side})"


@figure("vllm-second-sample", ENGINES)
def _vllm_second_sample(d: dict) -> str:
    second = [c["vllm"]["samples_mib"][1] for c in d["cases"].values()]
    negative = [x for x in second if x < 0]
    if not negative:
        return f"positive for every model ({_span(second, ',.0f', ' to ')} MiB)"
    every = "every model" if len(negative) == len(second) else f"{_word(len(negative))} of the {_word(len(second))}"
    return f"negative for {every} ({_span(negative, ',.0f', ' to ')} MiB)"


@figure("sglang-reserve-span", ENGINES, STARTUP_RUN)
def _sglang_reserve_span(d: dict, run: dict) -> str:
    reserve = sorted({c["sglang"]["reserve_mib"] for c in d["cases"].values()})
    drops = [c["executor"]["drop_mib"] for c in run["cases"].values()]
    same = f"{_mib(reserve[0])} MiB for every model" if len(reserve) == 1 else f"{_span(reserve, ',.0f', ' to ')} MiB"
    return f"{same}, against captures that took {_span(drops, ',.0f', ' to ')} MiB"


@figure("plan-total-error", STARTUP_RUN)
def _plan_total_error(d: dict) -> str:
    off = [abs(c["startup"]["predicted_total_mib"] - c["executor"]["drop_mib"]) for c in d["cases"].values()]
    return f"within {max(off):.0f} MiB of the executor's drop for every model"


STARTUP_GC = "startup-2026-11-29-32l.json"


@figure("full-gc", STARTUP_GC)
def _full_gc(d: dict) -> str:
    return f"{d['full_gc_s']:.2f} s in a server process holding {d['objects'] / 1e6:.0f} million live Python objects"


GRAPH_EXEC = "graph-exec-2026-12-01.json"


@figure("graph-exec-record", GRAPH_EXEC)
def _graph_exec_record(d: dict) -> str:
    cases = d["cases"].values()
    took = [c for c in cases if any(x["record_bytes"] for x in c["first"])]
    most = max((x["record_bytes"] for c in cases for x in c["first"]), default=0)
    count = max((sum(x["record_bytes"] > 0 for x in c["first"]) for c in took), default=0)
    if not took:
        return "nothing while a graph is recorded"
    at = "one recording" if count == 1 else f"up to {count} recordings"
    return (
        f"while a graph is recorded, {_mib(most / MiB)} MiB at {at} of {took[0]['graphs']} in {_word(len(took))} of the"
        f" {_word(len(d['cases']))} models, nothing in the others"
    )


@figure("graph-exec-per-node", GRAPH_EXEC)
def _graph_exec_per_node(d: dict) -> str:
    return _span([c["bytes_per_node"] for c in d["cases"].values()], ",.0f", " to ") + " bytes per node"


@figure("graph-exec-reference", GRAPH_EXEC)
def _graph_exec_reference(d: dict) -> str:
    r = d["cases"]["reference"]
    nodes = r["nodes"] / r["graphs"]
    return f"about {r['bytes_per_node'] * nodes / MiB:.1f} MiB for a 32-layer decode graph of ~{nodes:.0f} nodes"


@figure("graph-exec-step", GRAPH_EXEC)
def _graph_exec_step(d: dict) -> str:
    sizes = [x["instantiate_bytes"] for c in d["cases"].values() for x in c["first"] if x["instantiate_bytes"]]
    return f"{_mib(math.gcd(*sizes) / MiB)} MiB steps"


@figure("graph-exec-second", GRAPH_EXEC)
def _graph_exec_second(d: dict) -> str:
    most = max(c["second_round_bytes"] for c in d["cases"].values())
    return f"{_mib(most / MiB)} MiB more"


GRAPH_EXEC_FA3 = "graph-exec-2026-12-07-fa3-w2.json"
SIDE_STREAM = "side-stream-2026-12-07.json"


@figure("graph-exec-fa3", GRAPH_EXEC_FA3)
def _graph_exec_fa3(d: dict) -> str:
    cases = [c for c in d["cases"].values() if c.get("nodes")]
    inst = [c["instantiate_bytes"] / MiB for c in cases]
    return (
        f"{_span(inst, ',.0f')} MiB for {cases[0]['graphs']} FA3 decode graphs"
        f" ({_span([c['bytes_per_node'] for c in cases], ',.0f')} bytes a node; {_word(len(cases))} models),"
        f" their warm-ups {_span([c['warmup_bytes'] / MiB for c in cases], ',.0f')} MiB and first replays"
        f" {_span([c['replay_bytes'] / MiB for c in cases], ',.0f')} MiB"
    )


@figure("side-stream-gemm", SIDE_STREAM)
def _side_stream_gemm(d: dict) -> str:
    runs = [r for r in d["runs"] if "error" not in r]  # as the bench's summary: failed runs left out

    def of(step: str, key: str) -> str:
        return _span([r[step][key] / MiB for r in runs], ",.0f")

    growth = "reserved_growth_bytes"
    extra = _span([(r["first_side_stream"][growth] - r["default_stream"][growth]) / MiB for r in runs], ",.0f")

    return (
        f"a process's first GEMM takes {of('default_stream', 'outside_bytes')} MiB outside torch's allocator"
        f" (and {of('default_stream', 'reserved_growth_bytes')} MiB of workspace in it); a new stream's first GEMM"
        f" after it {of('first_side_stream', 'outside_bytes')} MiB outside"
        f" ({of('first_side_stream', 'reserved_growth_bytes')} MiB in it: the same workspace and, for the"
        f" {extra} MiB more, the product's own segment on a stream that had none), in {_word(len(runs))} fresh"
        " processes"
    )


SIDE_STREAM_POOLS = "side-stream-2026-12-07-streams.json"


@figure("side-stream-pools", SIDE_STREAM_POOLS)
def _side_stream_pools(d: dict) -> str:
    runs = [r for r in d["runs"] if "error" not in r]
    first = _span([r["first_torch_stream"]["outside_bytes"] / MiB for r in runs], ",.0f")
    second = _span([r["second_torch_stream"]["outside_bytes"] / MiB for r in runs], ",.0f")
    per = _span([r["raw_streams"]["per_stream_bytes"] / 1024 for r in runs], ",.0f")
    return (
        f"the process's first `torch.cuda.Stream()` takes {first} MiB outside torch's allocator, a second"
        f" {second} MiB, and a stream the driver makes alone {per} KiB, in {_word(len(runs))} fresh processes"
    )


def render_figures(text: str, where: str) -> str:
    """``text`` with every figure region's body rendered again; an unknown name is an error."""

    def one(m: re.Match) -> str:
        name, arg = m["name"], m["arg"]
        if name == "source":
            if not arg or not (RESULTS / arg).exists():
                raise SystemExit(f"{where}: figure source {arg!r}: no such file in bench/results/")
            body = source_figure(arg)
        elif name in FIGURES:
            fig = FIGURES[name]
            body = fig.render(*(_load(f) for f in fig.files))
        else:
            raise SystemExit(f"{where}: unknown figure {name!r}; known: source, {', '.join(FIGURES)}")
        head = f"<!-- fig: {name}{' ' + arg if arg else ''} -->"
        return f"{head}{body}<!-- /fig -->"

    return FIG.sub(one, text)


def render_tables(text: str, where: str) -> str:
    """``text`` with every table region's body rendered again; an unknown name is an error."""

    def one(m: re.Match) -> str:
        name = m["name"]
        if name not in TABLES:
            raise SystemExit(f"{where}: unknown table {name!r}; known: {', '.join(TABLES)}")
        return m[1] + "\n".join(TABLES[name]()) + "\n" + m[4]

    return REGION.sub(one, text)


def cli_reference() -> str:
    """docs/cli.md: every command's help, walked from the ``planner`` group."""
    import click

    from capture_plan.planner.cli import app

    out = [
        "# CLI reference",
        "",
        "<!-- generated by `python docs/generate.py` from the commands' help; do not edit -->",
        "",
        "What the commands do, their exit codes and the files they refuse to write: [the planner guide](planner.md).",
        "",
    ]

    def walk(cmd: click.Command, ctx: click.Context, path: list[str]) -> None:
        out.extend([f"{'#' * min(len(path) + 1, 4)} `{' '.join(path)}`", "", "```text", cmd.get_help(ctx), "```", ""])
        if isinstance(cmd, click.Group):
            for name in cmd.list_commands(ctx):
                sub = cmd.get_command(ctx, name)
                walk(sub, click.Context(sub, info_name=name, parent=ctx, **sub.context_settings), [*path, name])

    # the widths are inherited by the subcommands' contexts, as in a real invocation
    root = click.Context(
        app, info_name="planner", terminal_width=CLI_WIDTH, max_content_width=CLI_WIDTH, **app.context_settings
    )
    walk(app, root, ["planner"])
    return "\n".join(out).rstrip() + "\n"


SIZES = "sizes-2026-12-02.json"


def _front(d: dict) -> tuple[dict, dict]:
    """The chosen list and SGLang's default of the bench's calibrated front (its one phase)."""
    (ph,) = d["front"]["phases"]
    return ph["chosen"], next(r for r in ph["defaults"] if r["label"] == "SGLang default")


@figure("sizes-chosen", SIZES)
def _sizes_chosen(d: dict) -> str:
    chosen, _ = _front(d)
    return f"{chosen['graphs']} sizes pad ~{chosen['padding_pct']:.2f}% of the step time"


@figure("sizes-sglang", SIZES)
def _sizes_sglang(d: dict) -> str:
    _, sglang = _front(d)
    return f"{sglang['graphs']} sizes' ~{sglang['padding_pct']:.2f}%"


@figure("sizes-device", SIZES)
def _sizes_device(d: dict) -> str:
    chosen, sglang = _front(d)
    if chosen["device_bytes"] == sglang["device_bytes"]:
        return f"both at {chosen['device_bytes'] / MiB:,.1f} MiB of device memory"
    return f"at {chosen['device_bytes'] / MiB:,.1f} against {sglang['device_bytes'] / MiB:,.1f} MiB of device memory"


@figure("sizes-front-s", SIZES)
def _sizes_front_s(d: dict) -> str:
    return f"{d['cli_all_s']:.2f} s"


#: the README's figure of the front, drawn from :data:`SIZES`' ``front`` (planner/report/size_plot.py)
SIZES_FRONT = DOCS / "sizes-front.png"


def draw_figures(check: bool) -> list[str]:
    """Draw the figures made from committed results (docs/sizes-front.png); with ``check``, only
    name those missing: a PNG's bytes depend on matplotlib's version and fonts, so they are
    redrawn by ``python docs/generate.py``, not compared."""
    shown = str(SIZES_FRONT.relative_to(ROOT))
    if check:
        return [] if SIZES_FRONT.is_file() else [shown]
    from capture_plan.planner.report.size_plot import draw_front

    before = SIZES_FRONT.read_bytes() if SIZES_FRONT.is_file() else None
    draw_front(_load(SIZES)["front"], SIZES_FRONT, where=shown)
    if SIZES_FRONT.read_bytes() != before:
        print(f"wrote {shown}")
    return []


def generated() -> dict[Path, str]:
    """Each generated file and the text it should have."""
    files = {}
    for page in [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]:
        if page == CLI_PAGE:
            continue
        text = page.read_text()
        if REGION.search(text) or FIG.search(text):
            where = str(page.relative_to(ROOT))
            files[page] = render_figures(render_tables(text, where), where)
    files[CLI_PAGE] = cli_reference()
    return files


def main(argv: list[str]) -> int:
    check = argv == ["--check"]
    if argv and not check:
        print("usage: python docs/generate.py [--check]", file=sys.stderr)
        return 2
    stale = []
    for path, text in generated().items():
        if path.exists() and path.read_text() == text:
            continue
        if check:
            stale.append(str(path.relative_to(ROOT)))
        else:
            path.write_text(text)
            print(f"wrote {path.relative_to(ROOT)}")
    stale += draw_figures(check)
    for name in stale:
        print(
            f"{name}: stale (differs from what bench/results/*.json and the CLI give); fix: python docs/generate.py",
            file=sys.stderr,
        )
    return 1 if stale else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
