"""How often following a build's options through the planner returns to a module it had left.

Issue 50's target: following ``opts`` from each entry below returns to a module it already left
at most 4 times (issue 39's was 8; 22 when that issue was filed, 2, 7 and 7 when issue 50 was,
8, 8 and 8 once the capture sequence was followed too). This counts it, torch-free and without timing
anything (the count is structural: the same on any machine), for three entries:

  quickstart     ``build_plan(BuildOptions(backend="fa3", ci=True))``: the Quickstart build
  sizes_auto     ``build_plan`` of the same build with ``--sizes auto`` for the skewed traffic
                 of tests/data/traffic-skewed.csv (``sizes=SizeChoiceOptions(traffic=...)``)
  choose_sizes   ``choose_sizes(SizesOptions(build=..., choice=...))`` (``planner sizes``:
                 planner/sizes/command.py) of the same build and traffic

What is counted, precisely:

- **Tracked objects**: every object of the options' types, of the build resolved from
  them and of its capture sequence: ``BuildOptions`` and ``SizeChoiceOptions``
  (planner/inputs/build_options.py), ``SizesOptions`` (planner/sizes/sizes.py), ``Resolved``
  (planner/schedule/resolve.py), ``Build`` (planner/schedule/sequence.py: the resolved build
  with its strategies and their sequence) and ``CaptureSequence``
  (schemas/capture_sequence.py: what a build captures, in order; issue 50).
  Within one call of an entry every such object is the entry's options or made from them:
  the options it holds as fields (a ``SizesOptions``' ``build`` and ``choice``, a
  ``BuildOptions``' ``sizes``), a copy of them (``msgspec.structs.replace(opts, ...)``: a
  command without one option), the build resolved from them and its ``with_sizes`` and
  ``without_pins`` copies, the Build made of it and each capture sequence built for it.
- A frame **receives** a tracked object when one of its arguments is that object: a
  parameter by name (``self`` included), an element of its ``*args`` or a value of its
  ``**kwargs``. An object reached inside another argument (``resolve``'s ``read`` dict, a
  ``Choice`` holding the build) is not received.
- **The walk**: the frames that receive a tracked object, of Python functions defined in the
  capture_plan package, whose caller is the entry's frame or a frame of the walk, in the
  order they are called (``sys.setprofile`` ``call`` events; a generator's resumption is
  not a call). A function reached only through a frame that does not receive the options
  is not followed: the walk is the chain of calls the options travel down.
- **The module chain**: the walk's modules (paths relative to the repository root), in
  call order, with consecutive repeats merged into one link.
- **Re-entries**: the links of the module chain whose module is already earlier in the
  chain: how often the walk returns to a module it had left. A chain a -> b -> a -> c -> b
  has 2. The entry's own module is the chain's first link.

Prints each entry's walk (one line per link of the chain: the module and the functions
called in it, in order) and its count; writes JSON with date and machine to
bench/results/opts-walk-<date>[-<tag>].json (tests/test_opts_walk.py holds the target).
Run: python -m bench.opts_walk [--tag NAME] [--no-write]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.harness import REPO, add_out_dir, add_overwrite, header, main_exit, result_file

TRAFFIC = REPO / "tests" / "data" / "traffic-skewed.csv"
#: issue 50's bound on the re-entries of each entry's walk (issue 39's was 8)
TARGET = 4
#: the entries this measures (see the module docstring)
ENTRIES = ("quickstart", "sizes_auto", "choose_sizes")

# CPython's code flags of functions whose 'call' event is also raised on each resumption
_RESUMABLE = 0x20 | 0x80 | 0x100 | 0x200  # generator, coroutine, iterable coroutine, async generator


@dataclass
class Walk:
    """One entry's walk: its calls (module, function, depth below the entry) in call order."""

    entry: str
    calls: list[tuple[str, str, int]] = field(default_factory=list)

    @property
    def chain(self) -> list[tuple[str, list[str]]]:
        """The module chain: (module, the functions called in it while there), consecutive
        calls in one module merged into one link."""
        links: list[tuple[str, list[str]]] = []
        for module, func, _depth in self.calls:
            if links and links[-1][0] == module:
                links[-1][1].append(func)
            else:
                links.append((module, [func]))
        return links

    @property
    def reentries(self) -> int:
        return reentries(m for m, _ in self.chain)

    def modules_entered(self) -> dict[str, int]:
        """How often the chain enters each module (its links per module)."""
        counts: dict[str, int] = {}
        for m, _ in self.chain:
            counts[m] = counts.get(m, 0) + 1
        return counts

    def as_dict(self) -> dict[str, Any]:
        return {
            "reentries": self.reentries,
            "calls": len(self.calls),
            "chain": [{"module": m, "functions": fs} for m, fs in self.chain],
            "entered": self.modules_entered(),
        }


def reentries(chain: Iterable[str]) -> int:
    """The links of a module chain whose module is already earlier in it (consecutive repeats
    count once: they are one link)."""
    seen: set[str] = set()
    count = 0
    last = None
    for m in chain:
        if m == last:
            continue
        if m in seen:
            count += 1
        seen.add(m)
        last = m
    return count


def _package_root() -> Path:
    import capture_plan

    return Path(capture_plan.__file__).resolve().parent


def _module_of(filename: str, root: Path, cache: dict[str, str | None]) -> str | None:
    """The module path (relative to the package root) of a code object's file, or None
    outside the package (the package may be imported through a link: paths are resolved)."""
    if filename not in cache:
        if filename.startswith("<"):  # generated code (a dataclass's __init__, exec'd strings)
            cache[filename] = None
            return None
        path = Path(filename).resolve()
        cache[filename] = path.relative_to(root).as_posix() if path.is_relative_to(root) else None
    return cache[filename]


def _arguments(frame) -> list[Any]:
    """The values a frame was called with: its parameters, ``*args``' elements and
    ``**kwargs``' values."""
    co = frame.f_code
    n = co.co_argcount + co.co_kwonlyargcount
    names = list(co.co_varnames[:n])
    star = co.co_flags & 0x04  # CO_VARARGS
    stars = co.co_flags & 0x08  # CO_VARKEYWORDS
    local = frame.f_locals
    values = [local[name] for name in names if name in local]
    if star:
        values.extend(local.get(co.co_varnames[n], ()))
        n += 1
    if stars:
        values.extend(local.get(co.co_varnames[n], {}).values())
    return values


def _tracked_types() -> tuple[type, ...]:
    """The types of the objects a walk follows: the build's options, a size choice's, the
    build resolved from them and its capture sequence."""
    from capture_plan.planner.inputs.build_options import BuildOptions, SizeChoiceOptions
    from capture_plan.planner.schedule.resolve import Resolved
    from capture_plan.planner.schedule.sequence import Build
    from capture_plan.planner.sizes.sizes import SizesOptions
    from capture_plan.schemas.capture_sequence import CaptureSequence

    return (BuildOptions, SizeChoiceOptions, SizesOptions, Resolved, Build, CaptureSequence)


def walk(entry: str, fn: Callable[[Any], Any], opts: Any) -> Walk:
    """Call ``fn(opts)`` and record the walk of ``opts`` through it (the module docstring's
    definitions)."""
    tracked = _tracked_types()

    root = _package_root()
    modules: dict[str, str | None] = {}
    result = Walk(entry)
    entry_frame: list[Any] = []
    # the frames of the walk now running (id -> depth); their frames are held so ids stay unique
    active: dict[int, int] = {}
    held: list[Any] = []
    resumed: set[int] = set()

    def profile(frame, event, _arg):
        if event == "return":
            # a generator "returns" at each yield and goes on when resumed: its frame stays in
            # the walk (held, so its id is not reused), or calls it makes after a yield are lost
            if not frame.f_code.co_flags & _RESUMABLE:
                active.pop(id(frame), None)
            return
        if event != "call":
            return
        co = frame.f_code
        if co.co_flags & _RESUMABLE:
            if id(frame) in resumed:
                return
            resumed.add(id(frame))
            held.append(frame)
        if not entry_frame:
            if co is fn.__code__:
                entry_frame.append(frame)
                active[id(frame)] = 0
                result.calls.append((_module_of(co.co_filename, root, modules) or co.co_filename, co.co_qualname, 0))
                held.append(frame)
            return
        caller = frame.f_back
        if caller is None or id(caller) not in active:
            return
        module = _module_of(co.co_filename, root, modules)
        if module is None:
            return
        if not any(isinstance(v, tracked) for v in _arguments(frame)):
            return
        depth = active[id(caller)] + 1
        active[id(frame)] = depth
        held.append(frame)
        result.calls.append((module, co.co_qualname, depth))

    old = sys.getprofile()
    sys.setprofile(profile)
    try:
        fn(opts)
    finally:
        sys.setprofile(old)
    held.clear()
    if not entry_frame:
        raise RuntimeError(f"{entry}: {fn.__qualname__} was not called as a Python function")
    return result


def entries(names: Iterable[str] = ENTRIES) -> dict[str, Walk]:
    """The walks of the named entries (:data:`ENTRIES`)."""
    from capture_plan.planner.build import BuildOptions, build_plan
    from capture_plan.planner.inputs.build_options import SizeChoiceOptions
    from capture_plan.planner.sizes.command import choose_sizes
    from capture_plan.planner.sizes.sizes import SizesOptions

    quickstart = BuildOptions(backend="fa3", ci=True)
    choice = SizeChoiceOptions(traffic=TRAFFIC)
    runs = {
        "quickstart": (build_plan, quickstart),
        "sizes_auto": (build_plan, BuildOptions(backend="fa3", ci=True, sizes=choice)),
        "choose_sizes": (choose_sizes, SizesOptions(build=quickstart, choice=choice)),
    }
    return {name: walk(name, *runs[name]) for name in names}


def show(w: Walk) -> str:
    """The walk as text: one line per link of the chain, a re-entry marked ``<-``."""
    lines = [f"{w.entry}: {w.reentries} re-entries ({len(w.calls)} calls, {len(w.chain)} links)"]
    seen: set[str] = set()
    for module, funcs in w.chain:
        mark = "<-" if module in seen else "  "
        seen.add(module)
        lines.append(f"  {mark} {module}: {', '.join(funcs)}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_out_dir(ap)
    ap.add_argument("--tag", default="", help="file name suffix: opts-walk-<date>-<tag>.json")
    ap.add_argument("--no-write", action="store_true", help="print the walks only, write no JSON")
    add_overwrite(ap)
    args = ap.parse_args()
    res: dict[str, Any] = header(device=False)
    out = None if args.no_write else result_file(args, "opts-walk", res["date"], args.tag)
    walks = entries()
    for w in walks.values():
        print(show(w))
    res.update(
        target=TARGET,
        traffic=str(TRAFFIC.relative_to(REPO)),
        walks={name: w.as_dict() for name, w in walks.items()},
    )
    if out is not None:
        out.write(res)
        print(f"{out.path.name}: " + ", ".join(f"{n} {w.reentries}" for n, w in walks.items()))
    over = [n for n, w in walks.items() if w.reentries > TARGET]
    return 1 if over else 0


if __name__ == "__main__":
    main_exit(main)
