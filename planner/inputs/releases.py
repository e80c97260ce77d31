"""Engine releases, one data file each (``planner/data/releases/ENGINE-VERSION.toml``).

A release's file holds everything the project knows of it: its wheel (file name and
SHA-256), the hook rows the plugins patch and the contract checks (all of them, or,
with ``follows``, the release before's as ``[changes]`` moves them plus its own
``[[hooks]]``), the facts the vLLM plugin and the baselines follow (:class:`ReleaseFacts`,
each with its source in the wheel) and the name of the ``planner fit`` rule that sizes
its KV cache (``planner/data/fit_rules.toml``; whether the KV cache is sized before or
after capture is that rule's ``kind``, its one owner).

Who reads them: ``capture_plan.adapters.plugins.hooks`` (HOOKS, KNOWN, requirements),
the preset reader (``EnginePreset.releases``), ``planner fit`` (``rule_for``, the
wheels' digests), bench/baselines.py, docs/generate.py and the fake runners in
tests/engines. A release that keeps the behaviour the code knows is added by a file
alone (tests/test_releases.py adds one); one that changes it (0.34.0's KV cache sized
after capture) needs code too, keyed by a fact or the fit rule, never a version compare.

No torch, no engine import: the plugins' entry points read this first.
"""

import functools
from pathlib import Path
from typing import Any, Literal

import msgspec

from capture_plan.planner.inputs.resources import data

__all__ = ["Hook", "Change", "Wheel", "ReleaseFacts", "check_sources", "Release", "releases", "release", "DIRS"]

#: the folders whose ``*.toml`` files are releases (a test appends a temporary one)
DIRS: list[Path] = [Path(__file__).resolve().parent.parent / "data" / "releases"]


class Hook(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One hook row (``capture_plan.adapters.plugins.hook_point.HookPoint`` less the release)."""

    file: str
    name: str
    signature: str
    role: str


class Change(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a release changed of one row of the release it follows: the fields given replace
    the row's; ``gone`` drops it."""

    file: str | None = None
    name: str | None = None
    signature: str | None = None
    role: str | None = None
    gone: bool = False


class Wheel(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    file: str
    sha256: str


class ReleaseFacts(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What one vLLM release does that the plugin, the baselines and the fake runner follow,
    each fact with its source in the release's wheel."""

    #: who sizes the persistent buffer a warm-up keeps: ``first-warmup`` (its own
    #: descriptor's size) or ``widest`` (the widest descriptor's, up front)
    persistent_buffer: Literal["first-warmup", "widest"]
    #: uniform-decode graphs keyed by ``tokens`` (the shared sizes rounded up) or by
    #: ``requests`` (request counts per query length)
    decode_keys: Literal["tokens", "requests"]
    #: the draft decode graphs' sizes: the ``capture-sizes`` or a ``request-grid`` to max_num_seqs
    draft_decode_sizes: Literal["capture-sizes", "request-grid"]
    #: the block of the greedy argmax a draft samples with: 0 (torch's ``argmax``: its int64
    #: result alone) or the block width of a two-pass argmax whose float32 and int32 partials
    #: are [rows, ceil(vocab / block)]
    draft_argmax_block: int
    #: fact name -> "file: function" it comes from
    sources: dict[str, str]

    def __post_init__(self) -> None:
        check_sources(self, "[facts.sources]")


def check_sources(facts: Any, table: str) -> None:
    """A ValueError (msgspec locates it) where ``facts.sources`` does not name exactly the
    struct's other fields: every fact has its source (file: function), no source is of no fact."""
    names = {f.name for f in msgspec.structs.fields(facts)} - {"sources"}
    sources = facts.sources
    missing = sorted(names - set(sources))
    if missing:
        raise ValueError(f"facts without a source: {', '.join(missing)}; add them to {table}")
    unknown = sorted(set(sources) - names)
    if unknown:
        raise ValueError(f"sources of no fact: {', '.join(unknown)}")


class Release(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One engine release's file."""

    #: the engine's distribution name ("vllm", "sglang")
    engine: str
    version: str
    wheel: Wheel
    #: the ``[rules.NAME]`` of planner/data/fit_rules.toml that sizes its KV cache
    fit_rule: str
    #: the release whose hook rows this one's follow (its ``changes`` move them)
    follows: str | None = None
    changes: dict[str, Change] = {}
    #: its hook rows: all of them, or those it adds to the release it follows
    hooks: list[Hook] = []
    #: vLLM's release facts (:class:`ReleaseFacts`)
    facts: ReleaseFacts | None = None


def _version_key(r: Release) -> tuple:
    from packaging.version import Version

    return (r.engine, Version(r.version))


@functools.cache
def releases() -> tuple[Release, ...]:
    """Every release file of :data:`DIRS`, by engine then version (oldest first). A malformed
    file is a broken package (RuntimeError naming it); so is a file whose name is not
    ``ENGINE-VERSION.toml`` of its contents, or a ``follows`` no file is."""
    out = []
    for folder in DIRS:
        for path in sorted(folder.glob("*.toml")):
            rel = path.relative_to(DIRS[0].parent) if folder == DIRS[0] else path
            raw = data(str(rel)) if folder == DIRS[0] else _parse(path)
            try:
                r = msgspec.convert(raw, Release)
            except msgspec.ValidationError as err:
                raise RuntimeError(f"{path}: {err}") from None
            if path.stem != f"{r.engine}-{r.version}":
                raise RuntimeError(f"{path}: holds {r.engine} {r.version}; name it {r.engine}-{r.version}.toml")
            out.append(r)
    out.sort(key=_version_key)
    known = {(r.engine, r.version) for r in out}
    for r in out:
        if r.follows is not None and (r.engine, r.follows) not in known:
            raise RuntimeError(f"{r.engine} {r.version} follows {r.follows}, which has no release file")
    return tuple(out)


def _parse(path: Path) -> dict:
    from capture_plan.schemas.documents import toml_parser

    return toml_parser().loads(path.read_text())


def release(engine: str, version: str) -> Release:
    """The release file of ``engine`` ``version``; KeyError where there is none."""
    for r in releases():
        if (r.engine, r.version) == (engine, version):
            return r
    raise KeyError(f"{engine} {version}: no planner/data/releases/{engine}-{version}.toml")
