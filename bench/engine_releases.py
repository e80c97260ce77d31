"""Which engine releases the plugins' hook points hold in: the newest SGLang and vLLM
wheels (downloaded, not installed) against every known release's rows
(``capture_plan.adapters.plugins.hooks.HOOKS``), read with zipfile + ast as the contract
test reads them (``capture_plan.adapters.plugins.contract``).

    python -m bench.engine_releases                      # newest wheels into .cache/engine-wheels
    python -m bench.engine_releases --offline --wheels /work/engine-wheels --write

prints a compatibility table: per wheel (engine and release) and per known release of that
engine whose rows it was checked against, the rows held and the first broken ones. Exit 1
where the newest wheel of an engine holds no known release's rows whole: a release the
plugin would meet with a warning and the engine's own capture (``live.live_release``), to
follow within a day (a new row set, ``adapters/plugins/hooks_<engine>_<release>.py``:
``follow(...)``). ``--write`` keeps the result in ``bench/results/engine-releases-DATE.json``,
which docs/adoption.md's table renders (``docs/generate.py``'s ``releases``).
docs/ci/engine-releases.yml is an example workflow that runs it daily once copied into a
repository's .github/workflows/ (nothing here runs it).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.harness import REPO, add_overwrite, header, main_exit, result_file

#: where the wheels are kept between runs (git-ignored, as .ci/run keeps its own)
WHEELS = REPO / ".cache" / "engine-wheels"
_WHEEL = re.compile(r"^(?P<engine>[A-Za-z0-9_]+)-(?P<version>[^-]+)-.*\.whl$")


def newest(engine: str, folder: Path) -> Path:
    """The newest release of ``engine`` on the package index, downloaded into ``folder``
    (``pip download --no-deps --only-binary :all:``); its wheel's path."""
    folder.mkdir(parents=True, exist_ok=True)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "-q",
            "--no-deps",
            "--only-binary",
            ":all:",
            "-d",
            str(folder),
            engine,
        ],
        capture_output=True,
        text=True,
    )
    if out.returncode != 0:
        raise SystemExit(f"engine_releases: pip download {engine} failed: {out.stderr.strip().splitlines()[-1:]}")
    wheels = [(release_of(p), p) for p in folder.glob(f"{engine}-*.whl")]
    return max(((v, p) for v, p in wheels if v is not None), key=lambda vp: _key(vp[0][1]))[1]


def release_of(wheel: Path) -> tuple[str, str] | None:
    """(engine, version) of a wheel's file name; None for another file."""
    m = _WHEEL.match(wheel.name)
    return (m["engine"], m["version"]) if m else None


def _key(version: str):
    from packaging.version import Version

    return Version(version)


def compatibility(wheels: list[Path]) -> list[dict[str, Any]]:
    """Per wheel, per known release of its engine (newest first): the rows checked, those
    held, and each broken one (its name and the contract's line)."""
    from capture_plan.adapters.plugins import contract
    from capture_plan.adapters.plugins.hooks import HOOKS, KNOWN

    out = []
    for wheel in sorted(wheels, key=lambda p: (release_of(p) or ("", ""))[0]):
        found = release_of(wheel)
        if found is None or found[0] not in KNOWN:
            continue
        engine, version = found
        for rows_of in reversed(KNOWN[engine]):
            rows = [h for h in HOOKS if (h.engine, h.version) == (engine, rows_of)]
            broken = []
            for h in rows:
                problem = contract.check_wheel(wheel, [h])
                if problem:
                    broken.append({"name": h.name, "problem": problem[0]})
            out.append(
                {
                    "engine": engine,
                    "release": version,
                    "rows_of": rows_of,
                    "known": version in KNOWN[engine],
                    "rows": len(rows),
                    "held": len(rows) - len(broken),
                    "broken": broken,
                }
            )
    return out


def table(result: list[dict[str, Any]]) -> list[str]:
    """The compatibility table, Markdown: one line per (wheel, known release's rows)."""
    lines = ["| release | checked against the rows of | held | broken |", "| --- | --- | --- | --- |"]
    for r in result:
        names = ", ".join(f"`{b['name']}`" for b in r["broken"][:4])
        more = f" and {len(r['broken']) - 4} more" if len(r["broken"]) > 4 else ""
        unknown = "" if r["known"] else " (not known)"
        lines.append(
            f"| {r['engine']} {r['release']}{unknown} | {r['engine']} {r['rows_of']} | {r['held']} of {r['rows']} | "
            f"{names + more if names else 'none'} |"
        )
    return lines


def unfollowed(result: list[dict[str, Any]]) -> list[str]:
    """``engine version`` of each wheel that holds no known release's rows whole."""
    whole: dict[tuple[str, str], bool] = {}
    for r in result:
        key = (r["engine"], r["release"])
        whole[key] = whole.get(key, False) or not r["broken"]
    return [f"{e} {v}" for (e, v), ok in whole.items() if not ok]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--wheels", type=Path, default=WHEELS, help="folder of the wheels (default .cache/engine-wheels)")
    ap.add_argument("--offline", action="store_true", help="check the wheels already in --wheels; download nothing")
    ap.add_argument("--write", action="store_true", help="keep the result in bench/results/engine-releases-DATE.json")
    ap.add_argument("--out", default=str(REPO / "bench" / "results"), help="folder of the result JSON")
    add_overwrite(ap)
    args = ap.parse_args(argv)
    from capture_plan.adapters.plugins.hooks import KNOWN

    if args.offline:
        wheels = [p for p in sorted(args.wheels.glob("*.whl")) if (release_of(p) or ("",))[0] in KNOWN]
    else:
        wheels = [newest(engine, args.wheels) for engine in KNOWN]
        wheels += [p for p in sorted(args.wheels.glob("*.whl")) if release_of(p) in _known_pins() and p not in wheels]
    result = compatibility(wheels)
    print("\n".join(table(result)))
    if args.write:
        res = {**header(device=False), "wheels": sorted(p.name for p in wheels), "releases": result}
        out = result_file(args, "engine-releases", res["date"])
        out.write(res)
        print(f"wrote {out.path}")
    late = unfollowed(result)
    for name in late:
        print(
            f"engine_releases: {name} holds no known release's hook points whole; "
            "follow it in adapters/plugins/hooks_<engine>_<release>.py",
            file=sys.stderr,
        )
    return 1 if late else 0


def _known_pins() -> set[tuple[str, str]]:
    from capture_plan.adapters.plugins.hooks import KNOWN

    return {(e, v) for e, versions in KNOWN.items() for v in versions}


if __name__ == "__main__":
    main_exit(main)
