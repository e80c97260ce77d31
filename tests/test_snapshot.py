"""Memory snapshots as traces: restricted unpickling, windows, labels, same prediction as the JSON trace.

The snapshots here are written in torch.cuda.memory._snapshot()'s format by
replaying a recorded H200 trace through the allocator simulator (addresses
and segments as the caching allocator would give them), with eager warm-up
allocations outside the pool between captures, as engines' loops do. The GPU
test (tests/test_gpu_snapshot.py) checks a real dump.
"""

from __future__ import annotations

import os
import pathlib
import pickle
import subprocess
import sys

import msgspec
import pytest

from capture_plan.planner import BuildOptions, build_plan
from capture_plan.planner.allocator import PoolSim, round_size, segment_size
from capture_plan.planner.snapshot import load_snapshot, trace_from_snapshot
from capture_plan.schemas.errors import InputError
from capture_plan.schemas.spec import Phase
from capture_plan.schemas.trace import Trace

ROOT = pathlib.Path(__file__).resolve().parent.parent
H200 = ROOT / "plans/traces/fa3-ci.json"


def fake_snapshot(trace: Trace, order: list[int], warmup: bool = True) -> dict:
    """A snapshot dict of capturing ``order`` (batch sizes) into one pool, outputs kept."""
    pool = PoolSim()
    eager = 0x7F0000000000
    entries: list[dict] = [{"action": "segment_alloc", "addr": eager, "size": 2 << 20, "stream": 0}]
    segments: list[dict] = []
    by_bs = {c.bs: c for c in trace.captures}

    def e(action, addr, size):
        entries.append(
            {
                "action": action,
                "addr": addr,
                "size": size,
                "stream": 7,
                "time_us": len(entries),
                "frames": [{"filename": "x.py", "line": 1, "name": "f"}],
            }
        )

    for bs in order:
        if warmup:  # an eager warm-up outside the pool
            e("alloc", eager, 4096)
            e("free_requested", eager, 4096)
            e("free_completed", eager, 4096)
        live = {}
        for ev in by_bs[bs].events:
            if ev.op == "alloc":
                before = pool.segments
                b = pool.alloc(ev.size)
                if pool.segments != before:
                    size = segment_size(round_size(ev.size))
                    e("segment_alloc", b.addr, size)
                    segments.append(
                        {
                            "device": 0,
                            "address": b.addr,
                            "total_size": size,
                            "stream": 7,
                            "segment_type": "large",
                            "segment_pool_id": (1, 0),
                            "blocks": [],
                        }
                    )
                live[ev.id] = b
                e("alloc", b.addr, ev.size)
            else:
                b = live.pop(ev.id)
                e("free_requested", b.addr, b.size)
                e("free_completed", b.addr, b.size)
                pool.free(b)
    segments.append({"device": 0, "address": eager, "total_size": 2 << 20, "segment_pool_id": (0, 0), "blocks": []})
    return {"segments": segments, "device_traces": [entries], "allocator_settings": {"expandable_segments": False}}


def _h200() -> Trace:
    return msgspec.json.decode(H200.read_bytes(), type=Trace)


def test_snapshot_gives_the_same_captures_and_prediction_as_the_json_trace(tmp_path):
    """Every one of the 36 captures event for event; the prediction through
    ``build --trace`` at three of them (with all 36 equal event for event, more
    sizes would only simulate more of the same input)."""
    trace = _h200()
    sizes = sorted(c.bs for c in trace.captures)
    snap = pickle.dumps(fake_snapshot(trace, sorted(sizes, reverse=True)))
    got = trace_from_snapshot(snap, [Phase(name="decode", kind="decode", sizes=sizes)], "snap")
    want = {c.bs: c.events for c in trace.captures}
    assert {c.bs: c.events for c in got.captures} == want
    few = [1, 120, 256]
    spec = tmp_path / "s.toml"
    spec.write_text(f'[[phases]]\nname = "decode"\nkind = "decode"\nsizes = {few}\n')
    (tmp_path / "snap.pickle").write_bytes(pickle.dumps(fake_snapshot(trace, sorted(few, reverse=True))))
    a = build_plan(BuildOptions(backend="fa3", ci=True, spec=spec, trace=H200)).predicted
    b = build_plan(BuildOptions(backend="fa3", ci=True, spec=spec, trace=tmp_path / "snap.pickle")).predicted
    assert a.source == b.source == "trace" and len(a.timeline) >= len(few)
    assert (a.pool_bytes, a.pools, a.timeline, a.baseline_bytes) == (
        b.pool_bytes,
        b.pools,
        b.timeline,
        b.baseline_bytes,
    )


def test_cli_accepts_a_snapshot_and_refuses_a_miscounted_one(cli, tmp_path):
    trace = _h200()
    few = [1, 120, 256]
    (tmp_path / "s.toml").write_text(f'[[phases]]\nname = "decode"\nkind = "decode"\nsizes = {few}\n')
    (tmp_path / "snap.pickle").write_bytes(pickle.dumps(fake_snapshot(trace, [256, 120, 1])))
    code, out, err = cli("build", "-b", "fa3", "--spec", "s.toml", "--trace", "snap.pickle")
    assert code == 0 and "(trace," in out, err
    (tmp_path / "two.pickle").write_bytes(pickle.dumps(fake_snapshot(trace, [256, 1])))
    code, out, err = cli("build", "-b", "fa3", "--spec", "s.toml", "--trace", "two.pickle")
    assert code == 1 and err == (
        "planner: error: two.pickle: found 2 capture windows in the snapshot, the spec "
        "plans 3 captures (decode: 3); fix: dump the snapshot of a run that captured "
        "exactly the spec's sizes, each after an eager warm-up, or record the trace "
        "with capture_plan.executor.profile\n"
    )
    (tmp_path / "nowarm.pickle").write_bytes(pickle.dumps(fake_snapshot(trace, [256, 120, 1], warmup=False)))
    code, out, err = cli("build", "-b", "fa3", "--spec", "s.toml", "--trace", "nowarm.pickle")
    assert code == 1 and "found 1 capture windows" in err


class _Payload:
    """Unpickling this runs ``os.system`` -- what a malicious snapshot would do."""

    def __init__(self, marker: pathlib.Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_pickle_with_code_is_refused_before_it_runs(tmp_path, cli):
    marker = tmp_path / "pwned"
    data = pickle.dumps({"segments": [], "device_traces": [[{"action": _Payload(marker)}]]})
    # the payload is real: plain pickle runs it
    pickle.loads(data)
    assert marker.exists()
    marker.unlink()
    with pytest.raises(InputError, match=r"snap: pickle refers to (posix|os|nt)\.system: only plain data"):
        load_snapshot(data, "snap")
    (tmp_path / "s.toml").write_text('[[phases]]\nname = "decode"\nkind = "decode"\nsizes = [1]\n')
    (tmp_path / "evil.pickle").write_bytes(data)
    code, out, err = cli("build", "-b", "fa3", "--spec", "s.toml", "--trace", "evil.pickle")
    assert code == 1 and "evil.pickle: pickle refers to" in err and err.count("\n") == 1
    assert not marker.exists()


def test_payload_never_runs_in_a_fresh_process(tmp_path):
    """Out of process, so nothing this test imported can mask an execution."""
    marker = tmp_path / "ran"
    (tmp_path / "evil.pickle").write_bytes(pickle.dumps([1, _Payload(marker)]))
    code = (
        "import sys; from capture_plan.planner.snapshot import load_snapshot\n"
        "from capture_plan.schemas.errors import InputError\n"
        "try:\n    load_snapshot(open(sys.argv[1], 'rb').read(), 'x')\n"
        "except InputError as e:\n    print('refused', e)\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "evil.pickle")], capture_output=True, text=True, cwd=ROOT
    )
    assert r.stdout.startswith("refused x: pickle refers to"), r.stderr
    assert not marker.exists()


@pytest.mark.parametrize(
    "data,message",
    [
        (b"\x80\x04garbage", "not a readable pickle"),
        (pickle.dumps([1, 2]), "not a memory snapshot"),
        (pickle.dumps({"segments": [], "device_traces": []}), "the snapshot has no graph-pool segments"),
        (
            pickle.dumps({"segments": [{"segment_pool_id": 7}], "device_traces": []}),
            r"segments\[0\].segment_pool_id: segment_pool_id must be a pair of integers, got 7",
        ),
        (
            pickle.dumps(
                {"segments": [{"segment_pool_id": (1, 0), "address": "x", "total_size": 1}], "device_traces": []}
            ),
            r"segments\[0\]: missing or non-integer `address`",
        ),
        (
            pickle.dumps(
                {
                    "segments": [{"segment_pool_id": (1, 0), "address": 0, "total_size": 1}],
                    "device_traces": [[{"action": "segment_alloc", "addr": [1]}]],
                }
            ),
            r"device_traces\[0\]\[0\]: missing or non-integer `addr`",
        ),
        (
            pickle.dumps(
                {"segments": [{"segment_pool_id": (1, 0), "address": 0, "total_size": 1}], "device_traces": [[1, 2]]}
            ),
            r"device_traces\[0\]: the history must be a list of dicts",
        ),
    ],
)
def test_malformed_snapshots_are_refused(data, message):
    with pytest.raises(InputError, match=message):
        trace_from_snapshot(data, [Phase(name="decode", kind="decode", sizes=[1])], "snap")


def test_history_started_after_the_pool_is_refused():
    snap = fake_snapshot(_h200(), [256, 1])
    snap["device_traces"][0] = [e for e in snap["device_traces"][0] if e["action"] != "segment_alloc"]
    with pytest.raises(
        InputError,
        match=r"snap: device_traces\[0\]\[\d+\]: an allocation at 0x[0-9a-f]+ lies in a "
        "graph pool's segment created before the recorded history starts",
    ):
        trace_from_snapshot(pickle.dumps(snap), [Phase(name="decode", kind="decode", sizes=[1, 256])], "snap")


def test_an_older_idle_pool_is_ignored():
    trace = _h200()
    snap = fake_snapshot(trace, [256, 1])
    snap["segments"].append({"device": 0, "address": 0x10, "total_size": 2 << 20, "segment_pool_id": (9, 0)})
    got = trace_from_snapshot(pickle.dumps(snap), [Phase(name="decode", kind="decode", sizes=[1, 256])], "snap")
    assert {c.bs: c.events for c in got.captures} == {c.bs: c.events for c in trace.captures if c.bs in (1, 256)}
