"""`planner sizes` speed: the front of 1..64 sizes over 256 candidate sizes (issue 32's target).

Measures (median of --repeat runs, on this machine's CPU), for the skewed traffic of
tests/data/traffic-skewed.csv (256 sizes) and the embedded spec (SGLang's 36 sizes, fa3, --ci):

  cli_all_s        `planner sizes -b fa3 --ci --traffic ... --all` in a fresh process: every count
                   from 1 to 64 on the front, each list's pool simulated (wall, and the child's CPU
                   time in cli_all_cpu_s: the machine is shared, and its load slows the wall clock)
  front_s          the dynamic program alone (planner/sizes/size_front.py): the best list of each count
                   from 1 to 64 over the 256 candidates, the roofline's step times (in process)
  choose_s         choose_sizes in process, the table's selection of counts (the default output)
  captures         captures simulated by one choose_sizes --all (counted in a separate untimed run)

Also records the chosen list's padding against SGLang's default 36 sizes (roofline, approximate),
and the whole front calibrated with plans/calibration/h200-fa3-ci.json (``front``: every count
from 1 to 64, the engines' defaults and the chosen list, each with its device total), which
docs/generate.py draws as the README's figure (docs/sizes-front.png).

Writes JSON with date and machine to bench/results/sizes-<date>[-<tag>].json.
Run: python -m bench.sizes_bench [--repeat 3] [--tag NAME]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

from bench.harness import REPO, add_out_dir, add_overwrite, child_times, header, main_exit, median_time, result_file

TRAFFIC = REPO / "tests" / "data" / "traffic-skewed.csv"
CALIBRATION = REPO / "plans" / "calibration" / "h200-fa3-ci.json"


def _cli_all(repeat: int) -> tuple[float, float]:
    """Median wall and child CPU seconds of the CLI with --all."""
    args = ["sizes", "-b", "fa3", "--ci", "--traffic", str(TRAFFIC), "--all"]
    cmd = [sys.executable, "-m", "capture_plan.planner", *args]
    walls, cpus = zip(*(child_times(cmd, cwd=tempfile.gettempdir()) for _ in range(repeat)))
    return statistics.median(walls), statistics.median(cpus)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    add_out_dir(ap)
    ap.add_argument("--tag", default="", help="file name suffix: sizes-<date>-<tag>.json")
    add_overwrite(ap)
    args = ap.parse_args()
    res: dict = header(device=False)
    out = result_file(args, "sizes", res["date"], args.tag)

    import compileall

    for pkg in ("planner", "schemas"):
        compileall.compile_dir(str(REPO / pkg), quiet=1)

    from capture_plan.planner.build import BuildOptions, build_spec
    from capture_plan.planner.inputs.build_options import SizeChoiceOptions
    from capture_plan.planner.memory.simulate import Simulation
    from capture_plan.planner.schedule.resolve import resolve
    from capture_plan.planner.sizes.command import choose_sizes
    from capture_plan.planner.sizes.size_front import best_lists, candidates
    from capture_plan.planner.sizes.sizes import SizesOptions
    from capture_plan.planner.sizes.step_time import DEFAULT_CONTEXT, DEFAULT_DEVICE, device_roofline, roofline
    from capture_plan.planner.sizes.traffic import read_traffic

    res.update(repeat=args.repeat, traffic=str(TRAFFIC.relative_to(REPO)), loadavg_before=os.getloadavg())
    build = BuildOptions(backend="fa3", ci=True)
    spec = build_spec(build)
    phase = spec.phases[0]
    traffic = read_traffic(SizeChoiceOptions(traffic=TRAFFIC), {"decode": 1}, {"decode": 256})
    cands, _ = candidates(traffic.phases["decode"], 256)
    model = roofline(resolve(build), phase, device_roofline(DEFAULT_DEVICE), DEFAULT_CONTEXT)
    res["candidates"] = len(cands)
    res["front_s"] = median_time(lambda: best_lists(traffic.phases["decode"], cands, model.cost, 64), args.repeat)
    opts = SizesOptions(build=build, choice=SizeChoiceOptions(traffic=TRAFFIC))
    res["choose_s"] = median_time(lambda: choose_sizes(opts), args.repeat)
    res["cli_all_s"], res["cli_all_cpu_s"] = _cli_all(args.repeat)

    counted = {"captures": 0}
    capture = Simulation.capture

    def counting(self, *a, **k):
        counted["captures"] += 1
        return capture(self, *a, **k)

    Simulation.capture = counting
    try:
        chosen = choose_sizes(SizesOptions(build=build, choice=SizeChoiceOptions(traffic=TRAFFIC), every=True))
    finally:
        Simulation.capture = capture
    res["captures"] = counted["captures"]
    (ph,) = chosen.phases
    sglang = next(r for r in ph.defaults if r.label == "SGLang default")
    res["chosen"] = {
        "sizes": list(ph.chosen.sizes),
        "padding_pct": ph.chosen.padding,
        "pool_bytes": ph.chosen.pool_bytes,
    }
    res["sglang_default"] = {
        "sizes": list(sglang.sizes),
        "padding_pct": sglang.padding,
        "pool_bytes": sglang.pool_bytes,
    }
    res["padding_provenance"] = "roofline (approximate)"
    from capture_plan.planner.report.size_plot import front_data

    calibrated = BuildOptions(backend="fa3", ci=True, calibration=CALIBRATION)
    front = choose_sizes(SizesOptions(build=calibrated, choice=SizeChoiceOptions(traffic=TRAFFIC), every=True))
    res["front"] = front_data(front, traffic=res["traffic"])
    res["front_calibration"] = str(CALIBRATION.relative_to(REPO))
    res["loadavg_after"] = os.getloadavg()
    out.write(res)
    print(json.dumps(res, indent=2, sort_keys=True))
    print(
        f"{out.path.name}: front (64 counts over {len(cands)} candidates) {res['front_s']:.2f} s; "
        f"choose_sizes {res['choose_s']:.2f} s; CLI --all {res['cli_all_s']:.2f} s wall, "
        f"{res['cli_all_cpu_s']:.2f} s CPU; load {res['loadavg_before'][0]:.1f} -> {res['loadavg_after'][0]:.1f}"
    )


if __name__ == "__main__":
    main_exit(main)
