"""The engine-faithful runners as the engines ship them, for the engine plugins.

The plugins route the released engines' own code, unchanged. The runners of this
folder are the adopted versions (the manual route); the version before the adoption
(:func:`engines.adoption.before_module`, read back from the same file) is the
engine's code, with the release's class, method and parameter names where the
plugins hook them. :func:`release` (``sglang_release``, ``vllm_release``) places that version
under the engines' module paths in this process (``sys.modules``, through
``monkeypatch``: undone after the test), as the installed engine would be, and report
the release the plugins know as installed; the plugins then resolve their hook
points (``capture_plan.adapters.plugins.hooks``) to these classes.

``fits``: the fake machine fits every plan (the plan's environment check is the
real one on a GPU).
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

from capture_plan.adapters.plugins import core, hooks, sglang as sgl_plugin, vllm as vllm_plugin

from . import adoption, sglang_runner, vllm_runner

SGLANG = "sglang", "0.5.23"
VLLM = "vllm", "0.33.0"
#: what a vLLM release does (its release file's ``[facts]``: persistent_buffer, decode_keys,
#: draft_decode_sizes) -> the files that change 0.33.0's runner into one that does it (run over
#: its namespace, in order: the runner, then the worker's start-up around it). Keyed by the facts,
#: never a version: a release file with facts a runner already follows gets it with no edit here
LATER = {
    ("widest", "requests", "request-grid"): tuple(
        Path(__file__).with_name(f) for f in ("vllm_runner_034.py", "vllm_worker_034.py")
    ),
}
#: the vLLM releases the plugin tests run on: every release file's (planner/data/releases/)
VLLM_RELEASES = hooks.KNOWN["vllm"]


def later(engine: str, version: str) -> tuple[Path, ...]:
    """The files that make the runner of ``engine`` ``version`` out of the first release's, as
    its release file's facts say; a release whose facts no runner follows is a KeyError naming them."""
    from capture_plan.planner.inputs.releases import release as release_file

    def shape(facts) -> tuple[str, ...]:
        return (facts.persistent_buffer, facts.decode_keys, facts.draft_decode_sizes)

    facts = release_file(engine, version).facts
    if facts is None or shape(facts) == shape(release_file(*VLLM).facts):  # the first release's runner as it is
        return ()
    key = shape(facts)
    if key not in LATER:
        raise KeyError(f"{engine} {version}: no runner of tests/engines follows the facts {key} (LATER)")
    return LATER[key]


def _place(monkeypatch, module, release: tuple[str, str]) -> None:
    """``module`` under the path of every hook point of ``release`` that it defines."""
    engine, version = release
    for h in hooks.HOOKS:
        if (h.engine, h.version) == release and hasattr(module, h.name.split(".")[0]):
            monkeypatch.setitem(sys.modules, h.module, module)
    monkeypatch.setattr(core, "installed", lambda dist: version if dist == engine else "(not installed)")


#: engine -> (its runner module of this folder, the release the plugins know, the plugin)
ENGINES = {"sglang": (sglang_runner, SGLANG, sgl_plugin), "vllm": (vllm_runner, VLLM, vllm_plugin)}


def release(monkeypatch, tmp_path: Path, engine: str, *, version: str | None = None, fits: bool = True):
    """``engine``'s runners as the release ships them (the version before the adoption:
    SGLang 0.5.23's runners and backend, vLLM 0.33.0's runner, managers and piece
    wrappers; ``version="0.34.0"``, or any release with its facts: 0.33.0's changed by
    :func:`later`'s files)
    under their module paths, reported as installed; returns the module (a fresh copy:
    a test may change it)."""
    runners, known, plugin = ENGINES[engine]
    if version is not None and version != known[1]:
        known = engine, version
    name = f"{engine}_release"
    module = adoption.before_module(Path(runners.__file__), tmp_path, name)
    for path in later(*known):  # the release's changes, over the first release's namespace
        exec(compile(path.read_text(), str(path), "exec"), vars(module))
    monkeypatch.delitem(sys.modules, name)  # after: a dataclass made above looks its module up
    _place(monkeypatch, module, known)
    if fits:
        monkeypatch.setattr(plugin, "_env_problems", lambda plan: [])
    return module


#: the tests' names for the two engines' releases
sglang_release = functools.partial(release, engine="sglang")
vllm_release = functools.partial(release, engine="vllm")


def plan_file(tmp_path: Path, plan, name: str = "plan.json") -> Path:
    """``plan`` written where ``CAPTURE_PLAN_PLAN`` can name it (sealed: a plan
    :func:`engines.plans.keyed` reshaped gets its digest)."""
    from capture_plan.schemas.codec import canonical_bytes, seal

    path = tmp_path / name
    path.write_bytes(canonical_bytes(seal(plan)))
    return path


def loops_on_cpu(monkeypatch) -> None:
    """Every plugin's capture loop on the CPU (the fake CUDA: tests/fake_cuda.py)."""
    import torch

    for plugin in (sgl_plugin, vllm_plugin):
        monkeypatch.setattr(plugin, "LOOP_OPTIONS", {"device": torch.device("cpu")})
