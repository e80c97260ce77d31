"""An engine the plugin cannot import is told apart from one whose hook points moved (issue 49,
bug 3), and the plan is read before the engine is checked.

Before: with vLLM not installed, registration said ``the installed vllm: vllm (not installed):
the hook points moved (... No module named 'vllm')); fix: pip install vllm==0.34.0, or a
capture-plan that knows vllm (not installed)``; with a dependency of vLLM's missing, ``fix: pip
install --force-reinstall vllm==0.34.0 (its objects are not the release's)``; and a wrong
``CAPTURE_PLAN_PLAN`` was never reported in those states (the release check ran first, and
its warning returned). No torch needed: the engines here are absent or fake packages.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest

from capture_plan.adapters.plugins import core, live, sglang as sgl_plugin, vllm as vllm_plugin
from capture_plan.adapters.plugins.contract import main as contract

PLUGINS = {"vllm": vllm_plugin, "sglang": sgl_plugin}
NEWEST = {"vllm": "0.34.0", "sglang": "0.5.23"}
MISSING_DEP = "capture_plan_absent_dep"


@pytest.fixture
def absent(monkeypatch):
    """Neither engine importable, neither installed (``None`` in sys.modules stops an import
    whatever the machine has installed)."""
    for engine in PLUGINS:
        for name in [m for m in sys.modules if m == engine or m.startswith(engine + ".")]:
            monkeypatch.delitem(sys.modules, name)
        monkeypatch.setitem(sys.modules, engine, None)
    monkeypatch.setattr(core, "installed", lambda dist: live.NOT_INSTALLED)


def fake_engine(monkeypatch, tmp_path: Path, engine: str, version: str, *, requires: str | None) -> None:
    """``engine`` ``version`` installed (a dist-info with ``requires`` as its Requires-Dist), its
    package importing a module that is not installed."""
    root = tmp_path / "site"
    (root / engine).mkdir(parents=True)
    (root / engine / "__init__.py").write_text(f"import {MISSING_DEP}\n")
    info = root / f"{engine}-{version}.dist-info"
    info.mkdir()
    meta = f"Metadata-Version: 2.1\nName: {engine}\nVersion: {version}\n"
    if requires:
        meta += f"Requires-Dist: {requires}\nRequires-Dist: unrelated-dist==1.0\n"
    (info / "METADATA").write_text(meta)
    for name in [m for m in sys.modules if m == engine or m.startswith(engine + ".")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(root))


def _plan(tmp_path: Path) -> Path:
    from capture_plan.planner.cli import main

    path = tmp_path / "plan.json"
    assert main(["build", "-b", "fa3", "--ci", "-o", str(path)]) == 0
    return path


def _refusal(plugin) -> str:
    with pytest.raises(SystemExit) as exit_:
        plugin.register()
    line = str(exit_.value.code)
    assert line.startswith("capture-plan: ") and "\n" not in line
    return line


@pytest.mark.parametrize("engine", PLUGINS)
def test_an_engine_not_installed_is_named_so_with_the_install_as_fix(absent, monkeypatch, tmp_path, engine, caplog):
    monkeypatch.setenv(core.ENV_PLAN, str(_plan(tmp_path)))
    line = _refusal(PLUGINS[engine])
    assert line.startswith(f"capture-plan: the installed {engine}: {engine} is not installed (import {engine}.")
    assert line.endswith(f"; fix: pip install {engine}=={NEWEST[engine]}, or unset CAPTURE_PLAN_PLAN")
    assert "moved" not in line and "(not installed) is" not in line
    monkeypatch.setenv(core.ENV_FALLBACK, "engine")  # the operator's choice: one warning, nothing installed
    with caplog.at_level(logging.INFO, logger="capture_plan.plugins"):
        PLUGINS[engine].register()
    ((level, message),) = [(r.levelno, r.message) for r in caplog.records]
    assert level == logging.WARNING and f"{engine} is not installed" in message


@pytest.mark.parametrize("listed", [True, False], ids=["listed-requirement", "unlisted"])
def test_an_engine_whose_dependency_is_missing_names_it_and_its_install(monkeypatch, tmp_path, listed):
    fake_engine(monkeypatch, tmp_path, "vllm", "0.34.0", requires="capture-plan-absent-dep>=1.2" if listed else None)
    monkeypatch.setenv(core.ENV_PLAN, str(_plan(tmp_path)))
    line = _refusal(vllm_plugin)
    assert line.startswith(
        "capture-plan: the installed vllm: vllm 0.34.0 is installed but its import fails: vllm.v1.worker.gpu."
    )
    assert f"needs module {MISSING_DEP!r}, which is not installed; fix: pip install " in line
    if listed:
        assert line.endswith("fix: pip install 'capture-plan-absent-dep>=1.2' (vllm 0.34.0's requirement)")
    else:
        assert f"fix: pip install {MISSING_DEP} (or the package that provides module {MISSING_DEP!r};" in line
    assert "force-reinstall" not in line and "moved" not in line


@pytest.mark.parametrize("engine", PLUGINS)
@pytest.mark.parametrize("state", ["not-installed", "dependency-missing"])
def test_a_wrong_plan_is_reported_whatever_the_engines_state(absent, monkeypatch, tmp_path, engine, state):
    """Before: the release check's warning returned first, and the plan was never read."""
    if state == "dependency-missing":
        monkeypatch.delitem(sys.modules, engine)
        fake_engine(monkeypatch, tmp_path, engine, NEWEST[engine], requires=None)
        monkeypatch.setattr(core, "installed", lambda dist: NEWEST[engine] if dist == engine else live.NOT_INSTALLED)
    monkeypatch.setenv(core.ENV_PLAN, str(tmp_path / "typo.json"))
    line = _refusal(PLUGINS[engine])
    assert line == (
        f"capture-plan: CAPTURE_PLAN_PLAN={tmp_path / 'typo.json'}: the plan file is not there; fix: build it "
        f"(planner build ... -o {tmp_path / 'typo.json'}), or unset CAPTURE_PLAN_PLAN"
    )


def test_the_contract_checks_the_installed_engine_as_registration_does(absent, monkeypatch, tmp_path, capsys):
    """``contract --installed`` without a GPU: an engine not installed, then one whose import fails,
    each one line and exit 1 (the rows matching and moving: tests/test_plugins.py)."""
    assert contract(["--installed", "vllm"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("the installed vllm: vllm is not installed") and "\n" not in err
    assert contract(["--installed"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == (
        "the installed engines: neither sglang nor vllm is installed; fix: pip install sglang==0.5.23 "
        "(or vllm==0.34.0), then python -m capture_plan.adapters.plugins.contract --installed"
    )
    assert contract(["--installed", "trtllm"]) == 1
    assert capsys.readouterr().err.strip() == (
        "--installed trtllm: no plugin for engine 'trtllm'; "
        "fix: name one of sglang, vllm, or none for every one installed"
    )
    monkeypatch.delitem(sys.modules, "vllm")
    fake_engine(monkeypatch, tmp_path, "vllm", "0.34.0", requires=None)
    monkeypatch.setattr(core, "installed", lambda dist: "0.34.0" if dist == "vllm" else live.NOT_INSTALLED)
    assert contract(["--installed"]) == 1
    assert "vllm 0.34.0 is installed but its import fails" in capsys.readouterr().err
