"""Shared fixtures: CLI runner, faked CUDA, GPU gating, a small EAGLE plan to edit."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

from capture_plan.adapters.plugins.hooks import KNOWN


def _cuda() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if _cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the device with `pytest -m gpu`)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# CI's strict runs (.ci/run sets CAPTURE_PLAN_ONLY_GPU_SKIPS=1): a test may skip there only for want
# of a GPU. Any other skip (a package not installed, a wheel not downloaded) is a check that did not
# run while CI stayed green (issue 49: the engine contract skipped on every clean clone), so the
# session fails and names each one.
_GPU_SKIP = "needs a CUDA GPU"
_OTHER_SKIPS: list[str] = []


def _note_skip(report) -> None:
    if report.skipped and isinstance(report.longrepr, tuple) and _GPU_SKIP not in str(report.longrepr[2]):
        _OTHER_SKIPS.append(f"{report.nodeid}: {report.longrepr[2]}")


def pytest_runtest_logreport(report):
    _note_skip(report)


def pytest_collectreport(report):
    # a module that skips as a whole (pytest.importorskip at its top) is a skip of collection,
    # which no test's report carries
    _note_skip(report)


def pytest_sessionfinish(session, exitstatus):
    if os.environ.get("CAPTURE_PLAN_ONLY_GPU_SKIPS") == "1" and _OTHER_SKIPS and exitstatus == 0:
        session.exitstatus = 1


def pytest_terminal_summary(terminalreporter):
    if os.environ.get("CAPTURE_PLAN_ONLY_GPU_SKIPS") == "1" and _OTHER_SKIPS:
        terminalreporter.section("skips that CI does not allow (CAPTURE_PLAN_ONLY_GPU_SKIPS=1)")
        for line in _OTHER_SKIPS:
            terminalreporter.line(line)
        terminalreporter.line(f"{len(_OTHER_SKIPS)} test(s) skipped for a reason other than a missing GPU: failing")


@pytest.fixture
def fake(monkeypatch):
    """torch.cuda faked on CPU, for the executor's protocol tests (tests/fake_cuda.py).

    Defined here rather than imported into each test module: an imported fixture
    is a module global that every test's parameter of the same name redefines."""
    pytest.importorskip("torch")
    from fake_cuda import install

    return install(monkeypatch)


@pytest.fixture(params=KNOWN["vllm"])
def vllm(request) -> str:
    """The vLLM release a vLLM test runs on: each release file's (planner/data/releases/), on
    its engine-faithful runner (tests/engines/plugged.py)."""
    return request.param


@pytest.fixture
def cli(capsys, monkeypatch, tmp_path):
    """Run ``planner ARGS`` in-process in a temp cwd; returns (code, stdout, stderr)."""
    from capture_plan.planner.cli import main

    monkeypatch.chdir(tmp_path)

    def run(*args: str):
        code = main(list(args))
        out, err = capsys.readouterr()
        return code, out, err

    return run


_PLANS: dict = {}


@pytest.fixture(scope="session")
def built():
    """``build_plan(BuildOptions(**kw))``, built once per session for the same ``kw``.

    Plans are immutable; tests that only read a plan share it instead of
    rebuilding the same one (the speculative preset costs about a second).
    """
    from capture_plan.planner import BuildOptions, build_plan

    def get(**kw):
        key = tuple(sorted(kw.items()))
        if key not in _PLANS:
            _PLANS[key] = build_plan(BuildOptions(**kw))
        return _PLANS[key]

    return get


@pytest.fixture
def data_file(monkeypatch):
    """``data_file(name, extra)``: the planner reads ``planner/data/<name>`` as the
    shipped bytes plus ``extra`` (every cache of the data cleared); the shipped
    files again after the test."""
    from capture_plan.planner.inputs import resources
    from capture_plan.planner.memory import analytic

    real = resources.data_bytes
    extras: dict[str, bytes] = {}

    def clear() -> None:
        for f in (
            resources.data,
            resources.backends,
            resources.phase_kinds,
            resources.rules_digest,
            resources.builtin_rules,
            resources.baseline,
            analytic._phase_kind_models,
        ):
            f.cache_clear()

    def use(name: str, extra: bytes) -> None:
        extras[name] = extra
        monkeypatch.setattr(resources, "data_bytes", lambda n: real(n) + extras.get(n, b""))
        clear()

    yield use
    monkeypatch.undo()
    clear()


@pytest.fixture(scope="module")
def eagle_plan() -> bytes:
    from capture_plan.planner import BuildOptions, build_plan, plan_bytes

    return plan_bytes(build_plan(BuildOptions(backend="fa3", speculative="eagle", max_bs=4)))


@pytest.fixture
def plan_raw(cli, tmp_path, eagle_plan) -> dict:
    """A small multi-phase plan at plans/fa3-eagle.json in the test's cwd (built once)."""
    (tmp_path / "plans").mkdir()
    (tmp_path / "plans/fa3-eagle.json").write_bytes(eagle_plan)
    return json.loads(eagle_plan)
