"""Tensor-parallel agreement and failure propagation, on the CPU with gloo.

Each test starts 2-4 processes with a gloo process group (loopback only) and a
hard timeout: a hang fails the test instead of hanging CI.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
if not torch.distributed.is_available():  # pragma: no cover
    pytest.skip("torch.distributed is not available", allow_module_level=True)

HARD_TIMEOUT = 60


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, scenario, plans, results):
    import datetime

    import torch.distributed as dist

    from capture_plan.executor import load_plan
    from capture_plan.executor.distributed import check_plan_agreement, run_synchronized

    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=10),
        )
        plan = load_plan(plans[scenario.get("plan_of", {}).get(rank, "tp")], check_env=False)
        env = {"device": "NVIDIA H200 sm90, torch 2.11.0", "backend module": "fa3_fwd_interface"}
        env.update(scenario.get("env_of", {}).get(rank, {}))
        check_plan_agreement(plan, env=env)
        if "fail_at" in scenario:
            bad_rank, bad_step = scenario["fail_at"]

            def do_step(step):
                if rank == bad_rank and step.index == bad_step:
                    raise RuntimeError("CUDA error: an illegal memory access was encountered")
                if step.op == "capture":  # the model's own collective inside a step
                    dist.all_reduce(torch.ones(1))

            run_synchronized(plan.steps, do_step)
        results[rank] = "ok"
    except Exception as err:  # noqa: BLE001 - the message is what the test checks
        results[rank] = f"{type(err).__name__}: {err}"
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _run(world, scenario, plans):
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        results = manager.dict()
        port = _port()
        procs = [ctx.Process(target=_worker, args=(r, world, port, scenario, plans, results)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(HARD_TIMEOUT)
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
        assert not hung, f"ranks {hung} hung"
        return dict(results)


@pytest.fixture(scope="module")
def plans(tmp_path_factory) -> dict[str, str]:
    from capture_plan.planner import BuildOptions, build_plan, plan_bytes

    d: Path = tmp_path_factory.mktemp("plans")
    out = {}
    for name, opts in {
        "tp": BuildOptions(backend="fa3", tp=2, max_bs=16),
        "tp-ci": BuildOptions(backend="fa3", tp=2, max_bs=16, ci=True),
        "tp-other": BuildOptions(backend="fa3", tp=2, max_bs=8),
        "tp4": BuildOptions(backend="fa3", tp=4, max_bs=16),
    }.items():
        path = d / f"{name}.json"
        path.write_bytes(plan_bytes(build_plan(opts)))
        out[name] = str(path)
    return out


def test_agreement_passes_when_every_rank_has_the_same_plan(plans):
    assert _run(2, {}, plans) == {0: "ok", 1: "ok"}
    assert _run(4, {"plan_of": {r: "tp4" for r in range(4)}}, plans) == {r: "ok" for r in range(4)}


@pytest.mark.parametrize(
    "scenario,needle",
    [
        ({"plan_of": {1: "tp-other"}}, "plan digest differs: ranks [0]: sha256:"),
        ({"plan_of": {1: "tp-ci"}}, "ci differs: ranks [0]: False; ranks [1]: True"),
        (
            {"env_of": {1: {"device": "no CUDA device, torch 2.11.0"}}},
            "device differs: ranks [0]: NVIDIA H200 sm90, torch 2.11.0; ranks [1]: no CUDA device",
        ),
    ],
)
def test_disagreement_fails_every_rank_with_the_same_message(plans, scenario, needle):
    results = _run(2, scenario, plans)
    assert results[0].startswith("EnvironmentMismatch") and needle in results[0]
    assert results[0].replace("rank 0 of 2", "") == results[1].replace("rank 1 of 2", "")


def test_world_size_other_than_the_planned_tp_fails_on_every_rank(plans):
    results = _run(2, {"plan_of": {0: "tp4", 1: "tp4"}}, plans)
    assert all("the plan is for tp=4 but the group has 2 ranks" in r for r in results.values())


@pytest.mark.parametrize("world,plan,fail_at", [(2, "tp", (1, 3)), (4, "tp4", (2, 0))])
def test_a_rank_failing_mid_capture_makes_every_rank_raise_naming_it(plans, world, plan, fail_at):
    results = _run(world, {"plan_of": {r: plan for r in range(world)}, "fail_at": fail_at}, plans)
    rank, step = fail_at
    for r in range(world):
        assert results[r].startswith("CaptureFailed"), results
        assert f"rank {rank} failed at step {step} (" in results[r]
        assert "illegal memory access" in results[r]


def test_not_initialized_is_a_clear_error():
    from capture_plan.executor import ExecutorError
    from capture_plan.executor.distributed import check_plan_agreement

    with pytest.raises(ExecutorError, match="torch.distributed is not initialized"):
        check_plan_agreement(object())
