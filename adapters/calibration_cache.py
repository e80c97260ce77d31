"""Start-up calibrations kept across start-ups: one file per model and environment.

A first start-up records a few sizes of the engine's model and measures its
driver memory (``capture_plan.adapters.startup``); nothing in that measurement
changes until the model, the device, the driver, torch, the backend, the
schedule or capture-plan does. So ``predict_startup(cache=folder)`` keeps it
here, keyed by all of those, and a later start-up reads it back instead of
recording: it then costs milliseconds, not a third of the capture.

The key (:func:`calibration_key`) is a mapping of named parts; the file is
named by its digest, and the file's own copy of the key is compared part for
part on reading, so a mismatch is told by name ("driver: the cache's is
580.95.05, this is 580.159.04"), never a silent reuse. What the key cannot see
is the engine's own code: ``model`` must name it (its version, the model's
config and dtype); :meth:`capture_plan.adapters.hf.HFTarget.model_key` does for
transformers models. Nor does it see capture-plan's own code beyond its version
and the files of the packages' modules (:func:`_code_identity`), nor a backend's
compiled library that is not imported yet when the start-up asks, or that is
loaded by path (:func:`_compiled` says which it sees). A calibration
that a capture then contradicts is dropped
(``capture_plan.adapters.startup.confirm_startup``): a change the key missed is
found at the first capture after it, which the engine's margin must cover.

A cache is a cache: an unreadable, truncated, edited or foreign file is logged
and recorded over, and a folder that cannot be read or written is logged and
recorded without; neither stops a start-up. Writes are atomic (a reader sees
the old entry or the new one). Not locked: two processes recording the same key
at once both write, and the last one wins; both entries are measurements of the
same thing. A capture that contradicts its entry removes that entry only, not
one written since (:meth:`CalibrationCache.discard`).
"""

from __future__ import annotations

import functools
import importlib.machinery
import importlib.util
import logging
import os
import sys
import types
from pathlib import Path, PurePath

import msgspec
import torch

from capture_plan.executor.device import driver_version
from capture_plan.planner.build import BuildOptions, build_spec
from capture_plan.schemas import __version__
from capture_plan.schemas.codec import canonical_bytes, plan_digest, sha256
from capture_plan.schemas.errors import InputError
from capture_plan.schemas.files import read_input, write_atomic
from capture_plan.schemas.keys import PlanIndex
from capture_plan.schemas.plan import Plan
from capture_plan.schemas.spec import Spec
from capture_plan.schemas.startup import STARTUP_VERSION, StartupCalibration

__all__ = ["CalibrationCache", "calibration_key"]

log = logging.getLogger("capture_plan.startup")


def _module_identity(module: str) -> str | None:
    """``module`` and the file it loads from, with its size and modification time, and
    the compiled libraries it has loaded (:func:`_compiled`): an upgrade or a rebuild of
    the backend changes it (a distribution's version would need ``importlib.metadata``'s
    scan of every installed package, 0.2 s); None when the module is not importable."""
    spec = importlib.util.find_spec(module.split(".")[0])
    if spec is None:
        return None
    if not spec.origin or not os.path.isfile(spec.origin):
        return module
    compiled = "".join(f", {name} {_stat(file)}" for name, file in _compiled(module))
    return f"{module} {spec.origin} {_stat(spec.origin)}{compiled}"


def _stat(file: str) -> str:
    try:
        st = os.stat(file)
    except OSError:  # a library removed under a running process: name it, do not fail the start-up
        return "(gone)"
    return f"{st.st_size} bytes {st.st_mtime_ns}"


#: packages whose identity the key has from elsewhere: torch by its version, the
#: standard library by the module files' paths (another Python is another site-packages)
_KEYED_ELSEWHERE = frozenset({"torch", *sys.stdlib_module_names})
_EXTENSIONS = tuple(importlib.machinery.EXTENSION_SUFFIXES)


def _compiled(module: str) -> list[tuple[str, str]]:
    """The extension modules (name, file) that ``module`` has loaded: those of its own
    package and of the packages it imports by name. A backend's kernels live in such a
    library, often in another package than its Python interface (``fa3_fwd_interface``
    imports ``fa3_fwd._C``), and are rebuilt in place (``pip install -e``,
    ``setup.py build_ext --inplace``) under an unchanged ``.py``.

    Only what is imported already is seen, never imported here: an import loads the
    library (FA3's is 100 MB) and registers its operators, and for one of a backend's
    alternative modules that the engine does not use (a plan names FA3's two
    packagings) it can fail where the engine's own import works. An engine imports the
    same modules at the same point of every start-up, so the key is the same from one to
    the next.
    A library loaded by path (``torch.ops.load_library``) is not an extension module and
    is not seen."""
    mod = sys.modules.get(module)
    if mod is None:
        return []
    tops = {module.split(".")[0]}
    tops.update(getattr(v, "__name__", "").split(".")[0] for v in vars(mod).values() if isinstance(v, types.ModuleType))
    tops -= _KEYED_ELSEWHERE
    if not tops:  # torch itself (a backend of torch's own, SDPA): no package left to look for in sys.modules
        return []
    found = []
    for name, m in list(sys.modules.items()):  # a copy: another thread may import meanwhile
        file = getattr(m, "__file__", None)
        if name.split(".")[0] in tops and isinstance(file, str) and file.endswith(_EXTENSIONS):
            found.append((name, file))
    return sorted(found)


#: environment variables that change what the capture allocates (the allocator's
#: configuration, cuBLAS's workspace, when kernels are loaded)
ENVIRONMENT = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "CUBLAS_WORKSPACE_CONFIG", "CUDA_MODULE_LOADING")


@functools.cache  # the modules this process runs were imported once: their files are read once
def _code_identity() -> str:
    """The size and modification time of every module of capture-plan's packages that
    make or read a calibration (schemas, planner, executor, adapters) and of the planner's
    data tables, as one digest: a changed planner under the same version records again."""
    import capture_plan.adapters
    import capture_plan.executor
    import capture_plan.planner
    import capture_plan.schemas

    parts = []
    for pkg in (capture_plan.schemas, capture_plan.planner, capture_plan.executor, capture_plan.adapters):
        assert pkg.__file__ is not None  # a package imported from files has one
        root = os.path.dirname(pkg.__file__)
        found = []
        # one os.walk for both suffixes, bytecode folders pruned: this is on every recording
        # start-up's path, and Path.rglob walked each package twice, __pycache__ included
        for folder, dirs, files in os.walk(root):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            rel = os.path.relpath(folder, root).replace(os.sep, "/")
            found += [
                (f if rel == "." else f"{rel}/{f}", os.path.join(folder, f))
                for f in files
                if f.endswith((".py", ".toml"))
            ]
        for rel, path in sorted(found):
            st = os.stat(path)
            parts.append(f"{pkg.__name__}/{rel} {st.st_size} {st.st_mtime_ns}")
    return sha256("\n".join(parts).encode())


def _device_part(device: torch.device | None) -> str:
    if device is not None and device.type != "cuda":  # a recording off CUDA (tests' fake)
        return str(device)
    props = torch.cuda.get_device_properties(device)
    return f"{props.name} sm{props.major}{props.minor}, {props.multi_processor_count} SMs, {props.total_memory} bytes"


def calibration_key(
    model: str, schedule: Plan, options: BuildOptions, device: torch.device | None, *, spec: Spec | None = None
) -> dict[str, str]:
    """What a start-up calibration depends on, by name.

    ``model``: the engine's name for its model code and shapes (see the module
    docstring); ``schedule``: the plan recorded from (its phases and steps: what is
    recorded and captured); ``options``: the build's options, with the spec they
    name by its content (their trace is the recording's, and left out; ``spec``: that
    spec where the caller has read it already); ``device``: None for the current CUDA
    device."""
    if not model:
        raise InputError(
            "a start-up cache needs the model's key",
            where="predict_startup(cache=...)",
            fix="pass model_key=... naming the engine's model code, config and dtype (HFTarget.model_key())",
        )
    # by content, not by path: an engine that writes its spec to a new folder at every
    # start-up (or names a checked-in plan instead of building one) keys the same build
    build = {
        **msgspec.to_builtins(
            msgspec.structs.replace(options, spec=None, trace=None, output=None, calibration=None),
            enc_hook=_path,
        ),
        "spec": msgspec.to_builtins(spec if spec is not None else build_spec(options)),
        # a device report the analytic build was calibrated with: by content too
        "calibration": _file_digest(options.calibration),
    }
    captured = msgspec.to_builtins({"phases": schedule.phases, "steps": schedule.steps})
    modules = [m for m in map(_module_identity, schedule.requires.modules) if m is not None]
    return {
        "model": model,
        "device": _device_part(device),
        "driver": driver_version(),
        "torch": f"{torch.__version__}, CUDA {torch.version.cuda}",
        "backend": ", ".join([schedule.requires.backend, *modules]),
        "schedule": sha256(canonical_bytes(captured)),
        "options": sha256(canonical_bytes(build)),
        "capture-plan": f"{__version__}, calibration {STARTUP_VERSION}, code {_code_identity()}",
        "environment": ", ".join(f"{k}={os.environ[k]}" for k in ENVIRONMENT if k in os.environ) or "(defaults)",
    }


def _file_digest(path: Path | None) -> str | None:
    if path is None:
        return None
    try:
        return sha256(Path(path).read_bytes())
    except OSError:
        return f"unreadable {Path(path).as_posix()}"


def _path(obj):
    if isinstance(obj, PurePath):  # the options' spec and calibration paths, as given
        return obj.as_posix()
    raise TypeError(f"cannot key a {type(obj).__name__}")


class CalibrationCache:
    """The folder of start-up calibrations (created on the first write)."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)

    def path(self, key: dict[str, str]) -> Path:
        return self.folder / f"startup-{sha256(canonical_bytes(key))[7:23]}.json"

    def load(self, key: dict[str, str]) -> StartupCalibration | None:
        """The calibration measured for ``key``; None (logged, with what differs from the
        nearest entry of the same model) when there is none or it cannot be used."""
        path = self.path(key)
        try:
            if not path.is_file():
                self._explain_miss(key)
                return None
            entry = msgspec.json.decode(read_input(path, "calibration"), type=StartupCalibration)
        except (OSError, InputError, msgspec.DecodeError, msgspec.ValidationError) as err:
            log.warning("start-up calibration %s is unreadable (%s): recording again", path, err)
            return None
        if entry.key != key:  # a digest collision or an edited file: compare by name, never reuse
            log.warning("start-up calibration %s is for %s: recording again", path, _differences(entry.key, key))
            return None
        problem = _inconsistent(entry)
        if problem:  # an edited or damaged entry: never captured from
            log.warning("start-up calibration %s: %s: recording again", path, problem)
            return None
        return entry

    def store(self, entry: StartupCalibration) -> Path | None:
        """Write ``entry``; its path, or None (logged) where the folder cannot be written."""
        path = self.path(entry.key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, canonical_bytes(entry))
        except (OSError, InputError) as err:
            log.warning("start-up calibration not written to %s (%s): the next start-up records again", path, err)
            return None
        log.info("start-up calibration written to %s", path)
        return path

    def discard(self, key: dict[str, str], entry: StartupCalibration | None = None) -> bool:
        """Remove ``key``'s entry; whether it did (a missing entry, or one that cannot be
        removed, logged, is not). With ``entry`` (the calibration a capture contradicted),
        only that one: an entry another start-up has written since, a newer measurement
        of the same key, is kept (a read and a removal, not one step: a write between
        the two is lost, and the start-up after records again)."""
        path = self.path(key)
        if entry is not None and path.is_file():
            try:
                there = msgspec.json.decode(read_input(path, "calibration"), type=StartupCalibration)
            except (InputError, msgspec.DecodeError, msgspec.ValidationError):
                there = None  # not an entry anyone can read: nothing to keep
            if there is not None and there != entry:
                log.info("start-up calibration %s was written again since it was read: kept", path)
                return False
        try:
            path.unlink()
            return True
        except FileNotFoundError:
            return False
        except OSError as err:
            log.warning("start-up calibration %s could not be removed (%s)", path, err)
            return False

    def _explain_miss(self, key: dict[str, str]) -> None:
        """Log why no entry fits: the parts in which this model's entries differ."""
        if not self.folder.is_dir():
            log.info("no start-up calibration in %s yet: recording", self.folder)
            return
        for other in sorted(self.folder.glob("startup-*.json")):
            try:
                got = msgspec.json.decode(read_input(other, "calibration"), type=StartupCalibration)
            except (InputError, msgspec.DecodeError, msgspec.ValidationError):
                continue
            if got.key.get("model") == key["model"]:
                log.info("start-up calibration %s is for %s: recording", other, _differences(got.key, key))
                return
        log.info("no start-up calibration for this model in %s: recording", self.folder)


def _inconsistent(entry: StartupCalibration) -> str:
    """What makes ``entry`` unusable though it decoded, or ""."""
    if plan_digest(entry.plan) != entry.plan.digest:
        return "its plan does not match its digest"
    if entry.driver is not None and len(entry.driver) != len(entry.plan.steps):
        return f"its driver figures cover {len(entry.driver)} of the plan's {len(entry.plan.steps)} steps"
    kinds = PlanIndex.of(entry.plan).kinds
    warmed = {s.phase for s in entry.plan.steps if s.op == "warmup"}
    missing = sorted(
        p for p in warmed if p not in entry.warmup_scratch and f"kind:{kinds[p]}" not in entry.warmup_scratch
    )
    return f"no warm-up scratch for {', '.join(missing)}" if missing else ""


def _differences(theirs: dict[str, str], ours: dict[str, str]) -> str:
    parts = [
        f"{k}: the cache's is {theirs.get(k, '(none)')!r}, this is {ours.get(k, '(none)')!r}"
        for k in sorted(set(theirs) | set(ours))
        if theirs.get(k) != ours.get(k)
    ]
    return "; ".join(parts) or "the same key"
