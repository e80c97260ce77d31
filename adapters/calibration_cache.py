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
transformers models. A calibration that a capture then contradicts is dropped
(``capture_plan.adapters.startup.confirm_startup``), so a change the key
missed costs one start-up's accuracy, within the engine's margin, once.

A cache is a cache: an unreadable, truncated or foreign file is logged and
recorded over, never an error that stops a start-up. Writes are atomic (a
reader sees the old entry or the new one). Not locked: two processes
recording the same key at once both write, and the last one wins; both
entries are measurements of the same thing.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path, PurePath

import msgspec
import torch

from capture_plan.executor.device import driver_version
from capture_plan.planner.build import build_spec
from capture_plan.schemas import __version__
from capture_plan.schemas.codec import canonical_bytes, plan_digest, sha256
from capture_plan.schemas.errors import InputError
from capture_plan.schemas.files import read_input, write_atomic
from capture_plan.schemas.plan import Plan
from capture_plan.schemas.startup import STARTUP_VERSION, StartupCalibration

__all__ = ["CalibrationCache", "calibration_key"]

log = logging.getLogger("capture_plan.startup")


def _module_identity(module: str) -> str | None:
    """``module`` and the file it loads from, with its size and modification time: an
    upgrade or a rebuild of the backend changes it (a distribution's version would need
    ``importlib.metadata``'s scan of every installed package, 0.2 s); None when the module
    is not importable."""
    spec = importlib.util.find_spec(module.split(".")[0])
    if spec is None:
        return None
    if not spec.origin or not os.path.isfile(spec.origin):
        return module
    st = os.stat(spec.origin)
    return f"{module} {spec.origin} {st.st_size} bytes {st.st_mtime_ns}"


def _device_part(device: torch.device | None) -> str:
    if device is not None and device.type != "cuda":  # a recording off CUDA (tests' fake)
        return str(device)
    props = torch.cuda.get_device_properties(device)
    return f"{props.name} sm{props.major}{props.minor}, {props.multi_processor_count} SMs, {props.total_memory} bytes"


def calibration_key(model: str, schedule: Plan, options: msgspec.Struct, device: torch.device | None) -> dict[str, str]:
    """What a start-up calibration depends on, by name.

    ``model``: the engine's name for its model code and shapes (see the module
    docstring); ``schedule``: the plan recorded from (its phases and steps: what is
    recorded and captured); ``options``: the build's options, with the spec they
    name by its content (their trace is the recording's, and left out); ``device``:
    None for the current CUDA device."""
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
            msgspec.structs.replace(options, spec=None, trace=None, output=None),  # pyright: ignore[reportArgumentType]
            enc_hook=_path,
        ),
        "spec": msgspec.to_builtins(build_spec(options)),  # pyright: ignore[reportArgumentType]
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
        "capture-plan": f"{__version__}, calibration {STARTUP_VERSION}",
    }


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
        if not path.is_file():
            self._explain_miss(key)
            return None
        try:
            entry = msgspec.json.decode(read_input(path, "calibration"), type=StartupCalibration)
        except (InputError, msgspec.DecodeError, msgspec.ValidationError) as err:
            log.warning("start-up calibration %s is unreadable (%s): recording again", path, err)
            return None
        if entry.key != key:  # a digest collision or an edited file: compare by name, never reuse
            log.warning("start-up calibration %s is for %s: recording again", path, _differences(entry.key, key))
            return None
        if plan_digest(entry.plan) != entry.plan.digest:  # an edited or damaged plan: never captured
            log.warning("start-up calibration %s: its plan does not match its digest: recording again", path)
            return None
        return entry

    def store(self, entry: StartupCalibration) -> Path:
        path = self.path(entry.key)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, canonical_bytes(entry))
        return path

    def discard(self, key: dict[str, str]) -> bool:
        """Remove ``key``'s entry; whether there was one."""
        try:
            self.path(key).unlink()
            return True
        except FileNotFoundError:
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


def _differences(theirs: dict[str, str], ours: dict[str, str]) -> str:
    parts = [
        f"{k}: the cache's is {theirs.get(k, '(none)')!r}, this is {ours.get(k, '(none)')!r}"
        for k in sorted(set(theirs) | set(ours))
        if theirs.get(k) != ours.get(k)
    ]
    return "; ".join(parts) or "the same key"
