"""Shared fixtures: CLI runner, GPU gating."""

from __future__ import annotations

import importlib.util

import pytest


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


@pytest.fixture
def cli(capsys, monkeypatch, tmp_path):
    """Run ``planner ARGS`` in-process in a temp cwd; returns (code, stdout, stderr)."""
    from planner.cli import main

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
    from planner import BuildOptions, build_plan

    def get(**kw):
        key = tuple(sorted(kw.items()))
        if key not in _PLANS:
            _PLANS[key] = build_plan(BuildOptions(**kw))
        return _PLANS[key]

    return get
