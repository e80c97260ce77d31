"""The devices the planner knows, and the one reading of ``--device NAME``.

Two tables key a device by the name torch gives it (``torch.cuda.get_device_name()``):
planner/data/fit_devices.toml (its memory total as torch and nvidia-smi report it, and its
compute capability: ``planner fit``, a build's KV pricing and ``planner build --device``'s
graph-exec estimate read it) and planner/data/devices.toml ``[roofline]`` (datasheet bandwidth
and BF16 peak: a size choice's step time without ``--timing``). A device is known when either
table names it; this module is the one owner of those names.

:func:`device_name` is how every command reads ``--device`` (``planner fit``, ``planner
build``, ``planner sizes``), alike: torch's name exactly, or case-insensitive words each a word
of exactly one known name (``H100``, ``h100 80gb``, ``a100-40gb``; torch's name in other case).
A word is a whole word of the name, never a part of one: ``H20``, ``L4`` and ``A10`` are devices
of their own, not the H200, the L40S or the A100s.
A name no known device has every word of is a :class:`DeviceRefused` naming the known
devices and the device nearest to it; a name more than one has (``nvidia``, ``A100``), or one
of no words at all (``''``), names the devices it matches (every known one) and, for its fix,
the first of them listed (fit_devices.toml's order) that the command can use: never a
"nearest" one, which among equal matches was an arbitrary pick (``nvidia`` was the RTX A5000).
Each command renders the refusal as its own command line with that device (``planner fit`` through its
:class:`~capture_plan.planner.fit.refusal.Refusal`, a build through :func:`refused`). A device
known but lacking what the command needs (``needs``: a memory total, roofline figures) is
refused alike, its device the nearest that has it.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable
from typing import TYPE_CHECKING, Literal

import msgspec

from capture_plan.schemas.errors import InputError

from .resources import data

if TYPE_CHECKING:
    from .build_options import BuildOptions

__all__ = [
    "Need",
    "NEEDS",
    "known_devices",
    "device_name",
    "DeviceRefused",
    "build_device",
    "refused",
    "capability",
    "roofline_row",
    "roofline_names",
]

#: what a command may need of a device: its memory total (planner/data/fit_devices.toml) or
#: its roofline figures (planner/data/devices.toml [roofline])
Need = Literal["memory", "roofline"]

#: each need: the table that gives it, and what it is, in words
NEEDS: dict[str, tuple[str, str]] = {
    "memory": ("planner/data/fit_devices.toml", "memory total"),
    "roofline": ("planner/data/devices.toml [roofline]", "roofline figures"),
}


class DeviceRefused(InputError):
    """A ``--device`` refused (:func:`device_name`): ``near``, the device each command's fix
    names (its own command line with it), and ``hint``, what that device is."""

    def __init__(self, what: str, *, hint: str, near: str) -> None:
        self.hint, self.near = hint, near
        super().__init__(what, where="--device", fix=f"{hint}: --device {near!r}")


def _memory() -> dict:
    return data("fit_devices.toml")["devices"]


def _roofline() -> dict:
    return data("devices.toml").get("roofline", {})


def known_devices() -> dict[str, frozenset[str]]:
    """Every known device by torch's name (fit_devices.toml's order, then the roofline table's
    others), with what the tables give of it (:data:`Need`)."""
    memory, roofline = _memory(), _roofline()
    names = [*memory, *(n for n in roofline if n not in memory)]
    return {n: frozenset(k for k, t in (("memory", memory), ("roofline", roofline)) if n in t) for n in names}


def _words(name: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", name.lower())


def _nearest(name: str, among: list[str]) -> str:
    """Of ``among``, the name matching most of ``name``'s words (ties: the closest spelling)."""
    words = _words(name)

    def matched(key: str) -> int:
        return sum(w in key.lower() for w in words)

    most = max(map(matched, among))
    near = [k for k in among if matched(k) == most] if most else among
    return (difflib.get_close_matches(name, near, n=1, cutoff=0) or near)[0]


def device_name(name: str, needs: Iterable[Need] = ()) -> str:
    """torch's name of the device ``name`` names (the module's docstring), one that has every
    one of ``needs``; else a :class:`DeviceRefused` naming the candidates, its ``near`` the
    nearest device that has ``needs``."""
    table = known_devices()
    want = set(needs)
    usable = [n for n, has in table.items() if want <= has]
    words = _words(name)
    found = [name] if name in table else [k for k in table if words and set(words) <= set(_words(k))]
    if len(found) == 1 and want <= table[found[0]]:
        return found[0]
    if len(found) == 1:  # known, without what the command needs
        where, what = NEEDS[min(want - table[found[0]])]
        others = [n for n in usable if n != found[0]]
        what = f"device {found[0]!r} has no {what} in {where} (listed there: {'; '.join(others)})"
        if "roofline" in want:
            what += "; without --timing a step time is the device's roofline"
        hint, among = "a device listed there", others
    elif found or not words:  # several, or none named: the first listed that the command can use
        if found:
            what = f"device {name!r} names {len(found)} devices: {'; '.join(found)}"
        else:
            what = f"no device named (--device {name!r} has no letters or digits; known: {'; '.join(table)})"
        first = next((n for n in found if n in usable), None)
        among = [n for n in found if n in usable] or usable
        hint = "name one of them, e.g. the first listed" if first else "name a known device, e.g. the first listed"
        if found and first is None:  # none of them has what the command needs
            where, needed = NEEDS[min(want)]
            hint = f"none of them has the {needed} this command reads ({where}): e.g. the first listed there"
        raise DeviceRefused(what, hint=hint, near=among[0])
    else:
        what, hint, among = f"unknown device {name!r} (known: {'; '.join(table)})", "the nearest known device", usable
    raise DeviceRefused(what, hint=hint, near=_nearest(found[0] if len(found) == 1 else name, among))


def capability(name: str) -> str | None:
    """The compute capability ("sm90") fit_devices.toml gives device ``name`` (torch's name), else None."""
    row = _memory().get(name)
    return None if row is None else str(row["sm"])


def roofline_names() -> list[str]:
    """The devices with roofline figures, sorted."""
    return sorted(_roofline())


def roofline_row(name: str) -> dict | None:
    """devices.toml's ``[roofline."NAME"]`` row of device ``name`` (torch's name), else None."""
    return _roofline().get(name)


def build_device(opts: BuildOptions) -> BuildOptions:
    """``opts`` (``planner build``'s, ``planner sizes``') with ``--device`` as torch names it
    (:func:`device_name`): what the build uses and the plan records. With ``--engine`` it has a
    memory total (the engine's sizing rule reads it), and under a size choice without
    ``--timing`` roofline figures (its step times). A refused name is one line (:func:`refused`)."""
    from .build_options import size_choice

    if opts.device is None:
        return opts
    choice = size_choice(opts)
    needs: list[Need] = []
    if opts.engine is not None:
        needs.append("memory")
    if choice is not None and choice.timing is None:
        needs.append("roofline")
    try:
        name = device_name(opts.device, needs)
    except DeviceRefused as err:
        raise refused(err, opts) from None
    return msgspec.structs.replace(opts, device=name)


def refused(err: DeviceRefused, opts: BuildOptions) -> InputError:
    """A build's refused ``--device`` as one line whose fix is the command (``planner build``, or
    ``planner sizes`` while it runs) with the device ``err`` names."""
    from .build_options import fix_command

    fixed = msgspec.structs.replace(opts, device=err.near)
    return InputError(err.what, where=err.where, fix=f"{err.hint}: `{fix_command(fixed)}`")
