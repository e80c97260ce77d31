"""The engine-faithful runners as the engines ship them, for the engine plugins.

The plugins route the released engines' own code, unchanged. The runners of this
folder are the adopted versions (the manual route); the version before the adoption
(:func:`engines.adoption.before_module`, read back from the same file) is the
engine's code, with the release's class, method and parameter names where the
plugins hook them. :func:`sglang_release` and :func:`vllm_release` place that version
under the engines' module paths in this process (``sys.modules``, through
``monkeypatch``: undone after the test), as the installed engine would be, and report
the release the plugins know as installed; the plugins then resolve their hook
points (``capture_plan.adapters.plugins.hooks``) to these classes.

``fits``: the fake machine fits every plan (the plan's environment check is the
real one on a GPU).
"""

from __future__ import annotations

import sys
from pathlib import Path

from capture_plan.adapters.plugins import core, sglang as sgl_plugin, vllm as vllm_plugin
from capture_plan.adapters.plugins.hooks import HOOKS

from . import adoption, sglang_runner, vllm_runner

SGLANG = "sglang", "0.5.23"
VLLM = "vllm", "0.33.0"


def _place(monkeypatch, module, release: tuple[str, str]) -> None:
    """``module`` under the path of every hook point of ``release`` that it defines."""
    engine, version = release
    for h in HOOKS:
        if (h.engine, h.version) == release and hasattr(module, h.name.split(".")[0]):
            monkeypatch.setitem(sys.modules, h.module, module)
    monkeypatch.setattr(core, "installed", lambda dist: version if dist == engine else "(not installed)")


def sglang_release(monkeypatch, tmp_path: Path, *, fits: bool = True):
    """SGLang 0.5.23's runners and backend (the version before the adoption) under
    their module paths; returns the module."""
    module = adoption.before_module(Path(sglang_runner.__file__), tmp_path, "sglang_release")
    monkeypatch.delitem(sys.modules, "sglang_release")
    _place(monkeypatch, module, SGLANG)
    if fits:
        monkeypatch.setattr(sgl_plugin, "_env_problems", lambda plan: [])
    return module


def vllm_release(monkeypatch, tmp_path: Path, *, fits: bool = True):
    """vLLM 0.33.0's runner, managers and piece wrappers (the version before the
    adoption) under their module paths; returns the module."""
    module = adoption.before_module(Path(vllm_runner.__file__), tmp_path, "vllm_release")
    monkeypatch.delitem(sys.modules, "vllm_release")
    _place(monkeypatch, module, VLLM)
    if fits:
        monkeypatch.setattr(vllm_plugin, "_env_problems", lambda plan: [])
    return module


def plan_file(tmp_path: Path, plan, name: str = "plan.json") -> Path:
    """``plan`` written where ``CAPTURE_PLAN_PLAN`` can name it (sealed: a plan
    :func:`engines.plans.keyed` reshaped gets its digest)."""
    from capture_plan.schemas.codec import canonical_bytes, seal

    path = tmp_path / name
    path.write_bytes(canonical_bytes(seal(plan)))
    return path
