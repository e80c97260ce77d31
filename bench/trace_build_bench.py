"""Planner speed from traces: a build from a recorded trace, its layers folded or flat.

A start-up prediction builds its plan from a few recorded sizes; most of that
build was simulating the trace's captures op by op. ``planner/memory/layers.py``
folds a capture's repeated layers so the simulator skips repeated layers as
it does for analytic programs. For each committed trace (and fa3-ci's trace
cut to the three sizes a start-up prediction records), the median wall time
of ``build_plan`` with folding and with every capture left flat (the
behaviour before), in this process, on this machine's CPU; and whether the
two plans are byte-identical (they must be).

Writes JSON (date, machine) to bench/results/trace-build-<date>[-<tag>].json.
Run: python -m bench.trace_build_bench [--repeat 5] [--tag TAG]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from bench.harness import REPO, add_out_dir, add_overwrite, header, main_exit, result_file

#: the H200's streaming multiprocessors, which a recording now writes into its trace (the
#: committed traces predate that): with it, EAGLE's draft phases derive from three sizes
H200_SMS = 132

CASES = {
    "fa3-ci, 3 recorded sizes": ("plans/traces/fa3-ci.json", None, (1, 120, 256)),
    "fa3-ci, every size": ("plans/traces/fa3-ci.json", None, None),
    "fa3-eagle-ci, 4 phases": ("plans/traces/fa3-eagle-ci.json", "eagle", None),
    # what a start-up prediction records: each phase's default three sizes, and the SM count
    "fa3-eagle-ci, 3 recorded sizes a phase": ("plans/traces/fa3-eagle-ci.json", "eagle", "default"),
}


def _trace(path: str, keep: tuple[int, ...] | str | None, folder: Path) -> Path:
    if keep is None:
        return REPO / path
    from capture_plan.schemas.trace import default_samples

    raw = json.loads((REPO / path).read_text())
    if keep == "default":
        sizes: dict[str, list[int]] = {}
        for c in raw["captures"]:
            sizes.setdefault(c["phase"], []).append(c["bs"])
        raw["captures"] = [c for c in raw["captures"] if c["bs"] in default_samples(sizes[c["phase"]])]
        raw["multiprocessors"] = H200_SMS
    else:
        raw["captures"] = [c for c in raw["captures"] if c["bs"] in keep]
    out = folder / "trace.json"
    out.write_text(json.dumps(raw))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--tag", default="", help="a suffix for the result file's name")
    add_out_dir(ap)
    add_overwrite(ap)
    args = ap.parse_args()

    from capture_plan.planner import BuildOptions, build_plan
    from capture_plan.planner.memory import layers
    from capture_plan.planner.memory.program import Program
    from capture_plan.schemas.codec import canonical_bytes

    folding = layers.fold

    def flat(ops, hint=None):
        return Program(prologue=ops), None

    res: dict = header(device=False)
    path = result_file(args, "trace-build", res["date"], *([args.tag] if args.tag else []))
    res.update(repeat=args.repeat, cases={})
    folder = Path(tempfile.mkdtemp())
    for name, (trace, speculative, keep) in CASES.items():
        opts = BuildOptions(backend="fa3", ci=True, speculative=speculative, trace=_trace(trace, keep, folder))
        row: dict = {}
        plans = {}
        for mode, fn in (("folded", folding), ("flat", flat)):
            layers.fold = fn
            times = []
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                plans[mode] = build_plan(opts)
                times.append(time.perf_counter() - t0)
            row[f"{mode}_s"] = statistics.median(times)
        layers.fold = folding
        row["identical"] = canonical_bytes(plans["folded"]) == canonical_bytes(plans["flat"])
        res["cases"][name] = row
        print(f"{name}: folded {row['folded_s']:.3f} s, flat {row['flat_s']:.3f} s, identical {row['identical']}")
    path.write(res)
    print(f"wrote {path.path}")
    parts = [f"{n} {r['flat_s']:.2f} -> {r['folded_s']:.2f} s" for n, r in res["cases"].items()]
    ok = all(r["identical"] for r in res["cases"].values())
    print("SUMMARY " + "; ".join(parts) + ("; plans identical" if ok else "; PLANS DIFFER"))


if __name__ == "__main__":
    main_exit(main)
