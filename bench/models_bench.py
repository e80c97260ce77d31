"""Models benchmark on one GPU: transformers models through capture-plan.

For each architecture, a transformers model built from a config with random
weights (no download), wrapped by ``capture_plan.adapters.hf.HFTarget``, with the 36 decode
sizes 1..256 of the default spec, and a spec whose ``[model]`` names the
model's config.json:

  loop       the engines' loop: largest-first, outputs kept, 2 warm-ups per
             size, torch.cuda.graph into one shared pool; replays vs eager
  alone      the largest size captured by itself (the floor)
  few-size   capture_plan.executor.profile at 3 sizes (smallest, median, largest); the
             planner derives the other 33 and plans from that trace
  executor   capture() of that plan: measured pool after every step against
             the prediction, and verify() with all three checks
  analytic   the plan from the config alone (a Llama-shaped model: MoE and
             other MLPs are not modelled), measured the same way, for contrast
  attention  the SDPA kernel PyTorch's dispatcher picks for the decode
             attention, with the adapter's pin (its default) and without it
             (PyTorch's choice), and for each: graphs of 8 sizes, each replayed
             3 times with fresh inputs and compared bit for bit with an eager
             run of the same inputs, and that eager run with a second one
             (a kernel whose eager runs differ is nondeterministic, not a
             capture fault)

Qwen2-MoE is also run a second time in a child process with expandable
segments (``--expandable-archs``; the allocator mode is fixed when CUDA
starts, so it needs its own process), planned with ``allocator =
"expandable"``: in native mode its pool is the small-pool need of batch 128
plus the large-pool need of batch 256 (see README, "Measured"), which
expandable segments do not split into 2 and 20 MiB segments.

Each model is the harness's case of its name (``bench.harness.case_target``): its static
KV cache length is sized for the device's free memory (``bench.harness.HF_MAX_SEQLEN``
where it fits, recorded per architecture as ``max_seqlen``); an architecture whose
shortest cache does not fit is skipped, saying why (``skipped``).

Writes JSON (date, device, versions, per architecture) to --out and prints a
markdown table and a one-line summary last.
Run: python -m bench.models_bench --out bench/results/models-DATE.json
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import traceback
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend

from bench.harness import (
    HF_ARCHS,
    HF_MAX_SEQLEN,
    RESULTS,
    MiB,
    ResultFile,
    add_overwrite,
    check_loop,
    engine_loop,
    fitted_target,
    header,
    largest_first,
    main_exit,
    refuse_dirty,
    release,
    replays_vs_eager,
    result_path,
    run_module,
)
from capture_plan.executor import capture, profile, verify, write_trace
from capture_plan.executor.pool import pool_reserved
from capture_plan.planner import BuildOptions, build_plan
from capture_plan.planner.inputs.specs import sgl_sizes

#: the architectures benchmarked (bench.harness.HF_ARCHS: config, attention implementation)
ARCHS = ("llama", "mixtral", "qwen2_moe", "gemma2")


def build_target(name: str, max_bs: int):
    """The ``HFTarget`` of architecture ``name`` for ``max_bs`` requests, the harness's case
    (4096 positions), sized for this device (``bench.harness.fitted_target``):
    ``(target, None)``, or ``(None, why)`` where it does not fit."""
    return fitted_target(name, None, max_bs=max_bs, max_position_embeddings=4096)


def write_spec(d: Path, cfg, sizes, allocator: str = "native") -> Path:
    raw = cfg.to_dict()
    raw["dtype"] = "bfloat16"
    (d / "config.json").write_text(json.dumps(raw, default=str, indent=1))
    spec = d / "spec.toml"
    spec.write_text(
        f'allocator = "{allocator}"\n\n[model]\nconfig = "config.json"\n\n[[phases]]\nname = "decode"\n'
        f'kind = "decode"\nsizes = {list(sizes)}\n'
    )
    return spec


def sdpa_choice(target, bs: int) -> str:
    """The kernel ``scaled_dot_product_attention`` dispatches to for this model's
    decode attention at batch ``bs``, under the target's current pin: the
    query as transformers makes it (a transpose of the projection), keys and
    values as after its ``repeat_kv`` (GQA with a mask), the target's mask."""
    cfg = target.model.config.get_text_config(decoder=True)
    heads = cfg.num_attention_heads
    dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    q = torch.empty(bs, 1, heads, dim, dtype=target.dtype, device=target.device).transpose(1, 2)
    kv = torch.empty(bs, heads, target.max_seqlen, dim, dtype=target.dtype, device=target.device)
    with target._attention():
        choice = torch._fused_sdp_choice(
            q, kv, kv, attn_mask=target._buffers[1].mask[:bs], dropout_p=0.0, is_causal=False
        )
    names = {int(getattr(SDPBackend, n)): n for n in dir(SDPBackend) if n.isupper()}
    return names.get(int(choice), str(choice))


def agreement(target, sizes, gen, trials: int = 3) -> dict:
    """Replays against eager runs of the same inputs, and eager against eager."""
    run = engine_loop(target, largest_first([("decode", sizes)]), warmups=1)
    rows = replays_vs_eager(target, run, gen, rounds=trials, eager_twice=True)
    release(run)
    return {
        "sizes": list(sizes),
        "replays": len(rows),
        "replay_not_equal_eager": sum(not r.equal for r in rows),
        "eager_not_equal_eager": sum(not r.eager_equal for r in rows),
        "max_abs_diff": max((r.max_abs_diff for r in rows), default=0.0),
    }


def attention_check(target, sizes, gen) -> dict:
    """The pinned kernels (the adapter's default) against PyTorch's own choice."""
    pin = target.sdpa_backends
    some = sorted(sizes)[::5] + ([max(sizes)] if (len(sizes) - 1) % 5 else [])
    res = {}
    try:
        for mode, backends in (("pinned", pin), ("pytorch_default", None)):
            target.sdpa_backends = backends
            res[mode] = {
                "backends": list(backends) if backends else None,
                "kernel": {bs: sdpa_choice(target, bs) for bs in (1, max(sizes))},
                **agreement(target, some, gen),
            }
    finally:
        target.sdpa_backends = pin
    return res


def few_size_plan(plan, target, spec: Path, tmp: Path):
    """The plan from 3 recorded sizes; where the planner refuses to derive the
    rest (samples that do not line up or fit), record 5, then every size,
    and keep the planner's messages: the JSON says how many were needed."""
    from capture_plan.schemas.errors import InputError
    from capture_plan.schemas.trace import default_samples

    sizes = plan.phases[0].sizes
    s = sorted(sizes)
    five = sorted(set(default_samples(sizes)) | {s[len(s) // 4], s[3 * len(s) // 4]})
    refused = []
    for choice in ("default", {"decode": five}, "all"):
        write_trace(profile(plan, target, sizes=choice), tmp / "trace.json")
        try:
            return build_plan(BuildOptions(backend="torch", spec=spec, trace=tmp / "trace.json")), refused
        except InputError as err:
            refused.append(str(err))
    raise AssertionError("unreachable: a trace of every size needs no fit")


def step_errors(plan, report) -> dict:
    """Prediction against measurement after every capture step."""
    captures = {s.index for s in plan.steps if s.op == "capture"}
    pred = {m.step: m.reserved for m in plan.predicted.timeline}
    errs = [(m.reserved - pred[m.step]) / m.reserved for m in report.steps if m.step in captures and m.reserved]
    worst = max(errs, key=abs) if errs else 0.0
    return {
        "steps": len(errs),
        "max_abs_error": abs(worst),
        "worst_error": worst,
        "pool_error": (plan.predicted.pool_bytes - report.pool_bytes) / report.pool_bytes,
    }


def bench_arch(name: str, sizes, tmp: Path, allocator: str = "native", attention: bool = True) -> dict:
    target, why = build_target(name, max(sizes))
    if why:
        return {"skipped": why}
    model = target.model
    cfg = model.config
    gen = torch.Generator(device="cuda")
    gen.manual_seed(0)
    res: dict = {
        "config": dict(HF_ARCHS[name][1]),
        "attention": HF_ARCHS[name][2],
        "max_seqlen": target.max_seqlen,
        "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
    }
    t_arch = time.perf_counter()
    target.run("decode", max(sizes), None)  # lazy initialisation outside every measurement
    torch.cuda.synchronize()

    run = engine_loop(target, [("decode", [max(sizes)])], warmups=1)
    res["alone_mib"] = pool_reserved([run.pool]) / MiB
    release(run)

    run = engine_loop(target, largest_first([("decode", sizes)]))
    res["loop"] = {
        "pool_mib": pool_reserved([run.pool]) / MiB,
        "capture_s": run.seconds,
        "replays_not_equal_eager": check_loop(target, run, gen),
        "replays": len(run.graphs),
    }
    release(run)

    spec = write_spec(tmp, cfg, sizes, allocator)
    plan = build_plan(BuildOptions(backend="torch", spec=spec))
    t0 = time.perf_counter()
    tplan, res["refused_fits"] = few_size_plan(plan, target, spec, tmp)
    res["profile_s"] = time.perf_counter() - t0
    samples = tplan.predicted.samples["decode"]
    res["recorded_sizes"] = samples.measured
    res["derived_sizes"] = len(samples.derived)

    gs = capture(tplan, target, progress=False)
    rep = gs.report
    res["executor"] = {
        "pool_mib": rep.pool_bytes / MiB,
        "capture_s": rep.capture_seconds,
        "predicted_mib": tplan.predicted.pool_bytes / MiB,
        "strategy": tplan.phases[0].strategy.label(),
        **step_errors(tplan, rep),
    }
    gs.release()
    res["loop"]["predicted_mib"] = tplan.predicted.baseline_bytes / MiB
    res["loop"]["prediction_error"] = (tplan.predicted.baseline_bytes / MiB - res["loop"]["pool_mib"]) / res["loop"][
        "pool_mib"
    ]
    res["predicted_alone_mib"] = tplan.predicted.largest_graph_bytes / MiB

    gs = capture(tplan, target, progress=False, record=True)
    v = verify(gs)
    res["verify"] = {"checks": list(v.checks), "replays": v.replays, "faults": len(v.faults), "summary": v.summary()}
    gs.release()

    gs = capture(plan, target, progress=False)  # the analytic plan, for contrast
    res["analytic"] = {
        "predicted_mib": plan.predicted.pool_bytes / MiB,
        "pool_mib": gs.report.pool_bytes / MiB,
        "error": (plan.predicted.pool_bytes - gs.report.pool_bytes) / gs.report.pool_bytes,
    }
    gs.release()

    if attention and res["attention"] != "eager":
        res["attention_check"] = attention_check(target, sizes, gen)

    res["ratios"] = {
        "executor_vs_alone": res["executor"]["pool_mib"] / res["alone_mib"],
        "executor_vs_loop": res["executor"]["pool_mib"] / res["loop"]["pool_mib"],
    }
    res["seconds"] = time.perf_counter() - t_arch
    del target, model
    release()
    return res


def expandable_child(name: str) -> dict:
    """``name`` benchmarked in a child process started with expandable segments."""
    env = dict(
        os.environ, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True", PYTORCH_ALLOC_CONF="expandable_segments:True"
    )
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "child.json"
        run = run_module(
            "models_bench",
            ["--archs", name, "--allocator", "expandable", "--expandable-archs", "", "--out", str(out)],
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        if run.returncode or not out.exists():
            return {"error": f"child exited {run.returncode}: {run.stderr.strip()[-300:]}"}
        r = json.loads(out.read_text())["archs"][name]
    print(f"{name}@expandable", json.dumps(r, default=str)[:400], flush=True)
    return r


def table(archs: dict) -> str:
    rows = [
        "| model | loop MiB (pred.) | alone MiB | executor MiB (pred., worst step) | analytic pred. | verify | "
        "SDPA kernel: replays != eager, eager != eager (pinned / PyTorch's choice) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, r in archs.items():
        if "error" in r:
            rows.append(f"| {name} | failed: {r['error'][:60]} | | | | | |")
            continue
        if "skipped" in r:
            rows.append(f"| {name} | skipped: {r['skipped']} | | | | | |")
            continue
        e, lp = r["executor"], r["loop"]
        att = r.get("attention_check")
        sdpa = (
            " / ".join(
                f"{a['kernel'][max(a['kernel'])]}: {a['replay_not_equal_eager']}, "
                f"{a['eager_not_equal_eager']} of {a['replays']}"
                for a in (att["pinned"], att["pytorch_default"])
            )
            if att
            else "(eager attention)"
            if r["attention"] == "eager"
            else "(not measured)"
        )
        rows.append(
            f"| {name} | {lp['pool_mib']:.0f} ({lp['predicted_mib']:.0f}) | {r['alone_mib']:.0f} | "
            f"{e['pool_mib']:.1f} ({e['predicted_mib']:.1f}, {e['worst_error']:+.1%}) | "
            f"{r['analytic']['error']:+.0%} | {r['verify']['replays']} replays, "
            f"{r['verify']['faults']} faults | {sdpa} |"
        )
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="JSON path [bench/results/models-DATE.json]")
    ap.add_argument("--archs", default=",".join(ARCHS), help=f"comma-separated subset of {list(ARCHS)}")
    ap.add_argument(
        "--expandable-archs",
        default="qwen2_moe",
        help="architectures to run again in a child process with expandable segments ('' for none)",
    )
    ap.add_argument(
        "--allocator",
        choices=("native", "expandable"),
        default="native",
        help="the allocator mode this process was started with (set by the parent for its child)",
    )
    add_overwrite(ap)
    args = ap.parse_args()
    if args.allocator == "expandable" and "expandable_segments:True" not in os.environ.get(
        "PYTORCH_CUDA_ALLOC_CONF", ""
    ):
        ap.error("--allocator expandable needs PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True in the environment")
    import transformers

    t0 = time.perf_counter()
    sizes = sgl_sizes("decode", 256)
    res: dict = header(device=True)
    path = args.out or result_path(RESULTS, "models", res["date"])
    refuse_dirty(args.allow_dirty, path)
    out = ResultFile(path, overwrite=args.overwrite, allow_dirty=args.allow_dirty)
    res.update(
        transformers=transformers.__version__,
        cudnn=torch.backends.cudnn.version(),
        allocator=args.allocator,
        sizes=sizes,
        max_seqlen=HF_MAX_SEQLEN,  # the most: each architecture's own is its "max_seqlen"
        archs={},
    )
    for name in args.archs.split(","):
        try:
            with tempfile.TemporaryDirectory() as d:
                res["archs"][name] = bench_arch(
                    name, sizes, Path(d), args.allocator, attention=args.allocator == "native"
                )
        except Exception as err:  # one architecture failing must not hide the others' results
            res["archs"][name] = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}
            release()
        print(name, json.dumps(res["archs"][name], default=str)[:400], flush=True)
    if args.allocator == "native":
        for name in [n for n in args.expandable_archs.split(",") if n in args.archs.split(",")]:
            res["archs"][f"{name}@expandable"] = expandable_child(name)
    res["seconds"] = time.perf_counter() - t0
    ok = {n: r for n, r in res["archs"].items() if "error" not in r and "skipped" not in r}
    skipped = {n: r["skipped"] for n, r in res["archs"].items() if "skipped" in r}
    res["targets"] = {
        "few_size_within_2pct_every_step": all(r["executor"]["max_abs_error"] <= 0.02 for r in ok.values()),
        "executor_within_1.05x_alone": all(r["ratios"]["executor_vs_alone"] <= 1.05 for r in ok.values()),
        "verify_clean": all(r["verify"]["faults"] == 0 for r in ok.values()),
        "all_ran": len(ok) == len(res["archs"]),
        # per model, the better of its native and expandable-segments runs
        "executor_within_1.05x_alone_best_allocator": all(
            min(r["ratios"]["executor_vs_alone"] for n, r in ok.items() if n.split("@")[0] == base) <= 1.05
            for base in {n.split("@")[0] for n in ok}
        ),
        "pinned_attention_replays_equal_eager": all(
            r["attention_check"]["pinned"]["replay_not_equal_eager"] == 0 for r in ok.values() if "attention_check" in r
        ),
    }
    out = out.write(res, default=str)
    print(table(res["archs"]))
    worst = max((r["executor"]["max_abs_error"] for r in ok.values()), default=float("nan"))
    alone = max((r["ratios"]["executor_vs_alone"] for r in ok.values()), default=float("nan"))
    att = [r["attention_check"] for r in ok.values() if "attention_check" in r]
    ne = {m: sum(a[m]["replay_not_equal_eager"] for a in att) for m in ("pinned", "pytorch_default")}
    ee = {m: sum(a[m]["eager_not_equal_eager"] for a in att) for m in ("pinned", "pytorch_default")}
    kern = {m: sorted({k for a in att for k in a[m]["kernel"].values()}) for m in ("pinned", "pytorch_default")}
    print(
        f"ATTENTION SDPA models: PyTorch's choice {kern['pytorch_default']}: {ne['pytorch_default']} replays != "
        f"eager, {ee['pytorch_default']} eager != eager; pinned {kern['pinned']}: {ne['pinned']} replays != eager, "
        f"{ee['pinned']} eager != eager (of {sum(a['pinned']['replays'] for a in att)} each)"
    )
    print(
        f"SUMMARY {len(ok)}/{len(res['archs'])} architectures in {res['seconds']:.0f} s"
        + "".join(f"; {n} SKIPPED: {why}" for n, why in skipped.items())
        + f"; few-size prediction worst "
        f"step error {worst:.2%}; executor pool <= {alone:.3f}x largest graph alone; verify faults "
        f"{sum(r['verify']['faults'] for r in ok.values())}; targets {res['targets']}; wrote {out}"
    )


if __name__ == "__main__":
    main_exit(main)
