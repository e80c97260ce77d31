"""Differential test of ``planner/memory/allocator.py`` (PoolSim) against PyTorch's CUDA caching allocator.

Random allocation programs -- sizes around the 512 B rounding, the 1 MiB
small/large boundary, the 10 MiB segment rule, 2 MiB rounding and 20 MiB
expandable pages; 1-4 captures per pool; blocks kept across captures; frees in
random order, inside captures and between them -- run under CUDA-graph capture
into a fresh private pool (``torch.cuda.graph_pool_handle()``) on one side
stream, allocating with ``torch.empty(n, dtype=torch.uint8, device="cuda")``.
After every capture the pool's segments are read from
``torch.cuda.memory_snapshot()`` (segments whose ``segment_pool_id`` is the
pool) and compared with PoolSim replaying the same program:

- ``match``: reserved bytes and the multiset of (small/large, segment bytes)
  equal at every capture's end (what the planner predicts);
- ``layout``: also the blocks inside every segment (sizes, allocated or free)
  and the allocated bytes.

Best fit breaks ties between equal free blocks by address, and a process that
has freed memory gets cudaMalloc addresses in no particular order; so PoolSim
replays each program with the real segments' base addresses (recorded as they
appear), which tests the rules. ``matches_planner_addresses`` counts the
matches with PoolSim's own increasing addresses, as the planner predicts.

Each allocator mode runs in its own process, because the mode is read from
``PYTORCH_ALLOC_CONF`` / ``PYTORCH_CUDA_ALLOC_CONF`` when CUDA initializes (the
child sets both, replacing any other allocator settings, and checks the
snapshot's ``is_expandable`` flags). Pools are released between programs
(tensors freed, graphs destroyed, ``torch.cuda.empty_cache()``); a pool that
keeps segments afterwards counts as a leak.

GPU:  python -m bench.allocator_diff --programs 2000 --out $OUT/allocdiff.json \
          [--fixture $OUT/allocator_diff.json]
CPU:  python -m bench.allocator_diff --recheck FILE   (replay saved measurements through PoolSim)

The JSON (``--out``) holds per mode the counts, the first mismatches in full
(program, real and simulated checkpoints) and the raw measurements of every
program (seed, program digest, segment addresses, checkpoints) so they can be
re-checked on a CPU later; ``--fixture`` writes a small self-contained subset
(the first programs of each mode with their ops, plus every mismatch kept: a
fixture with mismatches fails tests/test_allocator_diff.py until the model is
fixed) for ``tests/data/``; neither replaces an existing file without ``--overwrite``.
The summary line is printed last. Exit status: 0
when every program ran (whether or not it matched), 1 when a mode failed to
run, leaked or ran in the wrong mode, or (before anything runs) when ``--out`` or
``--fixture`` exists and ``--overwrite`` was not given.

Not covered: several streams, ``record_stream``, allocator settings other than
the mode, allocations outside captures.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.harness import (  # no torch until called
    DEVICE_FIELDS,
    ResultFile,
    header,
    main_exit,
    refuse_dirty,
    run_module,
)
from capture_plan.planner.memory.allocator import KiB, MiB, PoolSim  # CPU only, no torch

MODES = ("native", "expandable")
ALLOC_CONF = {"native": "expandable_segments:False", "expandable": "expandable_segments:True"}
GENERATOR = {"version": 2, "min_ops": 5, "captures": [1, 4], "free_p": 0.4, "repeat_p": 0.25}
FIRST_MISMATCHES = 10

# -- programs (pure Python, deterministic from the seed) ----------------------
#
# A program is a list of ops: ["b"] capture begin, ["a", slot, nbytes] alloc,
# ["f", slot] free, ["e"] capture end (a checkpoint). Allocs only happen inside
# captures; a slot is allocated once and freed at most once; blocks still
# allocated at the end are freed when the pool is released.


def sample_size(rng: random.Random) -> int:
    """One request size, from buckets that straddle each rule's boundary."""
    kind = rng.randrange(9)
    if kind == 0:
        return rng.randint(1, 4 * KiB)  # below 512 B and the first 512 B multiples
    if kind == 1:
        return max(1, 512 * rng.randint(1, 2048) + rng.choice((-1, 0, 1)))  # 512 B rounding edges
    if kind == 2:
        return MiB + rng.randint(-2 * KiB, 2 * KiB)  # small pool is <= 1 MiB after rounding
    if kind == 3:
        return rng.randint(1, MiB)  # small pool
    if kind == 4:
        return rng.randint(MiB + 1, 10 * MiB - 1)  # large, packed into 20 MiB segments
    if kind == 5:
        return 10 * MiB + rng.randint(-2 * KiB, 2 * KiB)  # 20 MiB segment vs its own segment
    if kind == 6:
        return 2 * MiB * rng.randint(5, 16) + rng.choice((-512, -1, 0, 1, 512))  # 2 MiB rounding
    if kind == 7:
        return 20 * MiB * rng.randint(1, 2) + rng.randint(-MiB, MiB)  # expandable 20 MiB pages
    return rng.randint(10 * MiB, 48 * MiB)  # large, own segment


def generate_program(seed: int, max_ops: int = 40) -> list[list]:
    """The program of ``seed``: ``GENERATOR['min_ops']``..``max_ops`` allocs/frees in 1-4 captures."""
    if max_ops < GENERATOR["min_ops"]:
        raise ValueError(f"max_ops must be >= {GENERATOR['min_ops']}, got {max_ops}")
    rng = random.Random(seed)
    n_ops = rng.randint(GENERATOR["min_ops"], max_ops)
    n_caps = rng.randint(*GENERATOR["captures"])
    cuts = sorted(rng.sample(range(1, n_ops), n_caps - 1))
    chunks = [b - a for a, b in zip([0, *cuts], [*cuts, n_ops])]
    ops: list[list] = []
    live: list[int] = []
    sizes: list[int] = []
    slot = 0
    for c, n in enumerate(chunks):
        if c and live and rng.random() < 0.5:  # between captures: free some kept blocks
            for _ in range(rng.randint(1, min(3, len(live)))):
                ops.append(["f", live.pop(rng.randrange(len(live)))])
        ops.append(["b"])
        for _ in range(n):
            if live and rng.random() < GENERATOR["free_p"]:
                ops.append(["f", live.pop(rng.randrange(len(live)))])
            else:
                # engines repeat sizes (layers): equal blocks, ties broken by address
                repeat = sizes and rng.random() < GENERATOR["repeat_p"]
                sizes.append(rng.choice(sizes) if repeat else sample_size(rng))
                ops.append(["a", slot, sizes[-1]])
                live.append(slot)
                slot += 1
        ops.append(["e"])
    return ops


def program_digest(ops: list[list]) -> str:
    return hashlib.sha256(json.dumps(ops, separators=(",", ":")).encode()).hexdigest()[:16]


# -- checkpoints: what one capture's end looks like ----------------------------
#
# {"reserved": int, "allocated": int,
#  "segments": [[kind, bytes], ...] sorted,
#  "layout": [[kind, [block, ...]], ...] sorted; a block is +size allocated, -size free}


def _canonical(segs: list[tuple[str, int, list[int]]]) -> dict:
    return {
        "reserved": sum(n for _, n, _ in segs),
        "allocated": sum(b for _, _, blocks in segs for b in blocks if b > 0),
        "segments": sorted([k, n] for k, n, _ in segs),
        "layout": sorted([k, list(blocks)] for k, _, blocks in segs),
    }


def checkpoint_from_sim(pool: PoolSim) -> dict:
    return _canonical(
        [
            ("small" if small else "large", n, [s if used else -s for s, used in blocks])
            for small, n, blocks in pool.layout()
        ]
    )


def pool_key(pool_id) -> tuple[int, ...]:
    """graph_pool_handle() and snapshots spell pool ids differently (tuple or list)."""
    return tuple(int(x) for x in pool_id)


def checkpoint_from_snapshot(segments: list[dict], key: tuple[int, ...]) -> tuple[dict, set]:
    """The checkpoint of pool ``key`` from ``torch.cuda.memory_snapshot()``, and its ``is_expandable`` flags."""
    segs = []
    flags = set()
    for s in segments:
        pid = s.get("segment_pool_id")
        if pid is None or pool_key(pid) != key:
            continue
        blocks = [b["size"] if b.get("state") == "active_allocated" else -b["size"] for b in s["blocks"]]
        if sum(abs(b) for b in blocks) != s["total_size"]:
            raise ValueError(f"snapshot segment at {s.get('address')}: blocks do not add up to total_size")
        segs.append((s["segment_type"], s["total_size"], blocks))
        flags.add(s.get("is_expandable"))
    return _canonical(segs), flags


def _addresses_then_fresh(addresses: list[int]):
    """The real base addresses, then (a model that makes more segments than the GPU did) fresh ones above."""
    yield from addresses
    top = max(addresses, default=0)
    while True:
        top += 1 << 44
        yield top


def simulate(ops: list[list], expandable: bool, addresses: list[int] | None = None) -> list[dict]:
    """PoolSim's checkpoints for ``ops`` (one stream); ``addresses``: the real segments' base addresses."""
    pool = PoolSim(expandable=expandable, addresses=None if addresses is None else _addresses_then_fresh(addresses))
    live = {}
    out = []
    for op in ops:
        if op[0] == "a":
            live[op[1]] = pool.alloc(op[2])
        elif op[0] == "f":
            pool.free(live.pop(op[1]))
        elif op[0] == "e":
            out.append(checkpoint_from_sim(pool))
    return out


def compare(real: list[dict], sim: list[dict]) -> dict:
    """``match`` (reserved and segments), ``layout`` (everything) and the first difference."""
    if len(real) != len(sim):
        return {
            "match": False,
            "layout": False,
            "reserved_rel_diff": 1.0,
            "first_diff": {"checkpoints": {"real": len(real), "sim": len(sim)}},
        }
    rel = 0.0
    first = first_layout = None
    for i, (r, s) in enumerate(zip(real, sim)):
        rel = max(rel, abs(r["reserved"] - s["reserved"]) / max(r["reserved"], 1))
        if first is None and (r["reserved"] != s["reserved"] or r["segments"] != s["segments"]):
            first = {
                "checkpoint": i,
                "real": {k: r[k] for k in ("reserved", "segments")},
                "sim": {k: s[k] for k in ("reserved", "segments")},
            }
        if first_layout is None and r != s:
            first_layout = {"checkpoint": i, "real": r, "sim": s}
    return {
        "match": first is None,
        "layout": first_layout is None,
        "reserved_rel_diff": rel,
        "first_diff": first or first_layout,
    }


# -- the GPU side (torch is passed in: tests drive it with a fake) -------------


class GpuRunner:
    """Runs programs under capture into fresh private pools on one side stream."""

    def __init__(self, torch):
        self.torch = torch
        self.stream = torch.cuda.Stream()
        # One kernel per capture (an empty graph only warns, but is not what
        # engines capture); the tensor lives in the default pool. Run once
        # eagerly so that the kernel is loaded before any capture.
        self.static = torch.zeros(1, device="cuda")
        with torch.cuda.stream(self.stream):
            self.static.add_(1)
        torch.cuda.synchronize()

    def _segments(self, key) -> tuple[dict, set]:
        return checkpoint_from_snapshot(self.torch.cuda.memory_snapshot(), key)

    def _reserved(self) -> int:
        # the nested form skips memory_reserved()'s flattening of every statistic
        return self.torch.cuda.memory_stats_as_nested_dict()["reserved_bytes"]["all"]["current"]

    def _addresses(self, key) -> set[int]:
        return {
            s["address"]
            for s in self.torch.cuda.memory_snapshot()
            if s.get("segment_pool_id") is not None and pool_key(s["segment_pool_id"]) == key
        }

    def run(self, ops: list[list]) -> dict:
        """{"checkpoints", "segment_addrs", "flags", "leaked"} for one program.

        ``segment_addrs``: base addresses of the pool's segments in creation
        order (a new one shows as a rise of reserved bytes across one
        allocation, then as a new address in the snapshot).
        """
        torch = self.torch
        pool = torch.cuda.graph_pool_handle()
        key = pool_key(pool)
        addrs: list[int] = []
        live = {}
        graphs = []
        checkpoints = []
        flags: set = set()
        graph = None
        try:
            with torch.cuda.stream(self.stream):
                for op in ops:
                    if op[0] == "a":
                        before = self._reserved()
                        live[op[1]] = torch.empty(op[2], dtype=torch.uint8, device="cuda")
                        if self._reserved() != before:
                            addrs += sorted(self._addresses(key) - set(addrs))
                    elif op[0] == "f":
                        del live[op[1]]
                    elif op[0] == "b":
                        graph = torch.cuda.CUDAGraph()
                        graph.capture_begin(pool=pool)
                        self.static.add_(1)
                    elif op[0] == "e":
                        graph.capture_end()
                        graphs.append(graph)
                        graph = None
                        cp, f = self._segments(key)
                        checkpoints.append(cp)
                        flags |= f
        finally:
            if graph is not None:  # a failed capture: end it so that the stream is usable again
                try:
                    graph.capture_end()
                except Exception:  # noqa: BLE001 -- the original error is what matters
                    pass
            live.clear()
            graphs.clear()
            graph = None
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        left, _ = self._segments(key)
        return {"checkpoints": checkpoints, "segment_addrs": addrs, "flags": flags, "leaked": bool(left["segments"])}


def run_mode(
    mode: str, seeds: list[int], torch, max_ops: int = 40, first: int = FIRST_MISMATCHES, progress=None
) -> dict:
    """Run ``seeds``' programs in the current process, whose allocator is in ``mode``."""
    expandable = mode == "expandable"
    runner = GpuRunner(torch)
    res = {
        "alloc_conf": ALLOC_CONF[mode],
        "programs": len(seeds),
        "measured": 0,
        "matches": 0,
        "layout_matches": 0,
        "matches_planner_addresses": 0,
        "leaks": 0,
        "mode_check": "",
        "errors": [],
        "max_reserved_rel_diff": 0.0,
        "first_mismatches": [],
        "first_layout_mismatches": [],
        "measurements": [],
    }
    flags: set = set()
    t0 = time.perf_counter()
    for n, seed in enumerate(seeds):
        ops = generate_program(seed, max_ops)
        try:
            got = runner.run(ops)
        except Exception as e:  # noqa: BLE001 -- recorded; the device may be unusable after it
            res["errors"].append(f"seed {seed}: {type(e).__name__}: {e}")
            break
        real = got["checkpoints"]
        res["measured"] += 1
        res["leaks"] += got["leaked"]
        flags |= got["flags"]
        addrs = got["segment_addrs"]
        res["measurements"].append(
            {"seed": seed, "digest": program_digest(ops), "checkpoints": real, "segment_addrs": addrs}
        )
        sim = simulate(ops, expandable, addrs)
        cmp = compare(real, sim)
        res["matches"] += cmp["match"]
        res["layout_matches"] += cmp["layout"]
        res["matches_planner_addresses"] += compare(real, simulate(ops, expandable))["match"]
        res["max_reserved_rel_diff"] = max(res["max_reserved_rel_diff"], cmp["reserved_rel_diff"])
        if not cmp["layout"]:
            entry = {
                "seed": seed,
                "ops": ops,
                "segment_addrs": addrs,
                "real": real,
                "sim": sim,
                "first_diff": cmp["first_diff"],
                "reserved_rel_diff": cmp["reserved_rel_diff"],
            }
            key = "first_mismatches" if not cmp["match"] else "first_layout_mismatches"
            if len(res[key]) < first:
                res[key].append(entry)
        if progress and (n + 1) % 500 == 0:
            progress(f"{mode}: {n + 1}/{len(seeds)} programs, {res['matches']} match")
    res["seconds"] = round(time.perf_counter() - t0, 2)
    res["mode_check"] = mode_check(flags, expandable)
    return res


def mode_check(flags: set, expandable: bool) -> str:
    """ "ok" when every segment's ``is_expandable`` is the mode's; "wrong: ..." when the mode did not take."""
    if flags == {expandable}:
        return "ok"
    if flags <= {None}:
        return "unverified: the snapshot's segments carry no is_expandable flag"
    return f"wrong: segments with is_expandable in {sorted(map(str, flags))}, expected {expandable}"


def replay(programs: list[dict]) -> dict:
    """Re-check saved measurements on the CPU: per mode, programs and matches.

    Each entry has "mode", "checkpoints", "segment_addrs" and either "ops" or
    ("seed", "digest", and "max_ops" in the generator settings): then the
    program is regenerated and must have the recorded digest.
    """
    out: dict = {}
    for p in programs:
        mode = p["mode"]
        ops = p.get("ops")
        if ops is None:
            ops = generate_program(p["seed"], p.get("max_ops", 40))
            if program_digest(ops) != p["digest"]:
                raise ValueError(
                    f"seed {p['seed']}: the generator no longer makes the measured program "
                    f"(digest {program_digest(ops)} != {p['digest']}); re-measure on a GPU"
                )
        cmp = compare(p["checkpoints"], simulate(ops, mode == "expandable", p.get("segment_addrs")))
        r = out.setdefault(mode, {"programs": 0, "matches": 0, "layout_matches": 0, "mismatched_seeds": []})
        r["programs"] += 1
        r["matches"] += cmp["match"]
        r["layout_matches"] += cmp["layout"]
        if not cmp["match"]:
            r["mismatched_seeds"].append(p.get("seed"))
    return out


def programs_of(data: dict) -> list[dict]:
    """The measured programs of a ``--out`` file or a ``--fixture`` file, as ``replay`` takes them."""
    if "programs" in data and isinstance(data["programs"], list):  # fixture
        return data["programs"]
    max_ops = data.get("generator", {}).get("max_ops", 40)
    return [
        {"mode": mode, "max_ops": max_ops, **m}
        for mode, r in data.get("modes", {}).items()
        for m in r.get("measurements", [])
    ]


# -- files and the command line -----------------------------------------------


def summary_line(data: dict) -> str:
    parts = []
    for mode, r in data["modes"].items():
        if "measured" not in r:
            parts.append(f"{mode}: FAILED ({r.get('error', '?')})")
            continue
        s = (
            f"{mode} {r['matches']}/{r['programs']} match (layout {r['layout_matches']}; "
            f"{r['matches_planner_addresses']} with the planner's segment addresses)"
        )
        if r["matches"] < r["measured"]:
            s += f", worst reserved diff {100 * r['max_reserved_rel_diff']:.1f}%"
        if r["errors"] or r["leaks"] or r["mode_check"] != "ok" or r["measured"] < r["programs"]:
            s += f", {len(r['errors'])} error(s), {r['leaks']} leak(s), mode check: {r['mode_check']}"
        parts.append(s)
    return (
        f"allocator_diff: {'; '.join(parts)} -- {data.get('device', '?')}, torch {data.get('torch', '?')}, "
        f"{data.get('seconds', 0):.0f} s"
    )


def failed(data: dict) -> bool:
    return any(
        "measured" not in r
        or r["errors"]
        or r["leaks"]
        or r["mode_check"].startswith("wrong")
        or r["measured"] < r["programs"]
        for r in data["modes"].values()
    )


def make_fixture(data: dict, per_mode: int) -> dict:
    """A self-contained subset: the first ``per_mode`` programs per mode plus every mismatch kept."""
    max_ops = data["generator"]["max_ops"]
    progs = []
    for mode, r in data["modes"].items():
        chosen = {m["seed"]: m for m in r.get("measurements", [])[:per_mode]}
        for m in r.get("first_mismatches", []) + r.get("first_layout_mismatches", []):
            chosen[m["seed"]] = {"seed": m["seed"], "checkpoints": m["real"], "segment_addrs": m["segment_addrs"]}
        for seed, m in chosen.items():
            progs.append(
                {
                    "mode": mode,
                    "seed": seed,
                    "ops": generate_program(seed, max_ops),
                    "segment_addrs": m["segment_addrs"],
                    "checkpoints": m["checkpoints"],
                }
            )
    return {
        "bench": "allocator_diff",
        "date": data["date"],
        "device": data.get("device"),
        "torch": data.get("torch"),
        "programs": progs,
    }


COMPACT = ("measurements", "first_mismatches", "first_layout_mismatches", "programs")


def dumps(obj, indent: str = "") -> str:
    """JSON with one key per line, and the items of ``COMPACT`` lists one compact line each."""
    inner = indent + " "
    if isinstance(obj, dict) and obj:
        items = []
        for k, v in obj.items():
            if k in COMPACT and isinstance(v, list) and v:
                body = (",\n" + inner + " ").join(json.dumps(x, separators=(",", ":")) for x in v)
                items.append(f"{inner}{json.dumps(k)}: [\n{inner} {body}\n{inner}]")
            else:
                items.append(f"{inner}{json.dumps(k)}: {dumps(v, inner)}")
        return "{\n" + ",\n".join(items) + "\n" + indent + "}"
    return json.dumps(obj, separators=(", ", ": "))


def write_json(path: Path, data: dict, overwrite: bool = True) -> None:
    """``data`` at ``path`` as :func:`dumps` spells it (``overwrite``: else an existing file
    raises :class:`bench.harness.ResultExists`)."""
    ResultFile(path, overwrite=overwrite).write(text=dumps(data) + "\n")


def _child(args) -> int:
    """One mode in this process: set the allocator mode, then initialize CUDA."""
    if "torch" in sys.modules:
        print("allocator_diff: torch was imported before the allocator mode could be set", file=sys.stderr)
        return 2
    for var in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        os.environ[var] = ALLOC_CONF[args.mode]
    import torch

    if not torch.cuda.is_available():
        print("allocator_diff: no CUDA device; run on a GPU machine (or use --recheck FILE on a CPU)", file=sys.stderr)
        return 1
    seeds = list(range(args.seed, args.seed + args.programs))
    res = run_mode(
        args.mode, seeds, torch, args.max_ops, args.first, progress=lambda s: print(s, file=sys.stderr, flush=True)
    )
    head = header(device=True)
    res.update({k: head[k] for k in DEVICE_FIELDS})
    write_json(Path(args.out), res)
    return 0


def _parent(args) -> int:
    t0 = time.perf_counter()
    # checked before anything runs: a run never replaces an earlier one unasked
    refuse_dirty(args.allow_dirty, args.out)
    out = ResultFile(args.out, overwrite=args.overwrite, allow_dirty=args.allow_dirty)
    fixture = ResultFile(args.fixture, overwrite=args.overwrite, allow_dirty=args.allow_dirty) if args.fixture else None
    head = header(device=False)
    data = {
        "bench": "allocator_diff",
        "date": head["date"],
        "git_commit": head["git_commit"],
        "git_dirty": head["git_dirty"],
        "git_diff_sha256": head["git_diff_sha256"],
        "command": f"python -m bench.allocator_diff --programs {args.programs} --seed {args.seed} "
        f"--max-ops {args.max_ops}",
        "seed": args.seed,
        "programs_per_mode": args.programs,
        "generator": {**GENERATOR, "max_ops": args.max_ops},
        "modes": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        for mode in args.modes:
            part = Path(tmp) / f"{mode}.json"
            cmd = [
                "--mode",
                mode,
                "--programs",
                str(args.programs),
                "--seed",
                str(args.seed),
                "--max-ops",
                str(args.max_ops),
                "--first",
                str(args.first),
                "--out",
                str(part),
            ]
            try:
                proc = run_module("allocator_diff", cmd, capture_output=True, text=True, timeout=args.timeout)
                sys.stderr.write(proc.stderr)
                last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
                err = None if proc.returncode == 0 and part.exists() else f"exit {proc.returncode}: {last}"
            except subprocess.TimeoutExpired:
                err = f"timed out after {args.timeout} s"
            if err:
                data["modes"][mode] = {"error": err}
                continue
            res = json.loads(part.read_text())
            data.update({k: res.pop(k) for k in DEVICE_FIELDS if k in res})
            data["modes"][mode] = res
    data["seconds"] = round(time.perf_counter() - t0, 1)
    data["summary"] = summary_line(data)
    out.write(text=dumps(data) + "\n")
    if fixture:
        fixture.write(text=dumps(make_fixture(data, args.fixture_programs)) + "\n")
    print(data["summary"])
    return 1 if failed(data) else 0


def _recheck(path: Path) -> int:
    try:
        data = json.loads(path.read_text())
        res = replay(programs_of(data))
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"allocator_diff: {path}: cannot re-check: {e}", file=sys.stderr)
        return 1
    for mode, r in res.items():
        print(
            f"{mode}: {r['matches']}/{r['programs']} match (layout {r['layout_matches']})"
            + (f"; mismatched seeds {r['mismatched_seeds'][:20]}" if r["mismatched_seeds"] else "")
        )
    ok = bool(res) and all(r["matches"] == r["programs"] for r in res.values())
    print(f"allocator_diff --recheck {path}: {'all match' if ok else 'MISMATCH'}")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--programs", type=int, default=2000, help="programs per mode (default 2000)")
    ap.add_argument("--seed", type=int, default=0, help="first program's seed; programs use seed..seed+N-1")
    ap.add_argument("--max-ops", type=int, default=40, help="most allocs+frees per program (default 40)")
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    ap.add_argument("--first", type=int, default=FIRST_MISMATCHES, help="mismatches kept in full per mode")
    ap.add_argument("--out", help="JSON results (required on the GPU)")
    ap.add_argument("--fixture", help="also write a small self-contained subset here (for tests/data/)")
    ap.add_argument("--fixture-programs", type=int, default=40, help="programs per mode in --fixture")
    ap.add_argument("--timeout", type=int, default=600, help="seconds per mode")
    ap.add_argument("--overwrite", action="store_true", help="replace --out and --fixture where they exist")
    ap.add_argument(
        "--allow-dirty", action="store_true", help="measure from uncommitted changes (recorded with the diff's sha256)"
    )
    ap.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)  # internal: one mode, this process
    ap.add_argument("--recheck", metavar="FILE", help="replay a results or fixture file through PoolSim (CPU)")
    args = ap.parse_args(argv)
    if args.recheck:
        return _recheck(Path(args.recheck))
    if not args.out:
        ap.error("--out is required (or --recheck FILE)")
    if args.programs < 1 or args.max_ops < GENERATOR["min_ops"]:
        ap.error(f"--programs must be >= 1 and --max-ops >= {GENERATOR['min_ops']}")
    return _child(args) if args.mode else _parent(args)


if __name__ == "__main__":
    main_exit(main)
