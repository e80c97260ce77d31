"""Temporary: where predict_startup's time goes on the device (cProfile), per case."""
import cProfile, pstats, sys, tempfile, io
from pathlib import Path
import torch
from bench.harness import case_options, case_target
from capture_plan.planner import build_plan
from capture_plan.adapters.startup import predict_startup

case = sys.argv[1]
opts = case_options(case, Path(tempfile.mkdtemp()))
plan = build_plan(opts)
target = case_target(case, plan)
gen = torch.Generator(device="cuda"); gen.manual_seed(0)
for p in plan.phases:
    target.prepare(p.name, max(p.sizes), max(p.sizes), gen); target.run(p.name, max(p.sizes), None)
torch.cuda.synchronize(); torch.cuda.empty_cache()
pr = cProfile.Profile(); pr.enable()
pred = predict_startup(target, opts, schedule=plan)
pr.disable()
print(case, pred.timings)
s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(45); print(s.getvalue()[:9000])
s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25); print(s.getvalue()[:5000])
