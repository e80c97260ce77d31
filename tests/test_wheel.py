"""The distribution an engine installs: one top-level package, capture_plan.

Builds the wheel from this checkout (pip, the build backend pyproject.toml
names), installs it without dependencies into a fresh virtual environment and
lists what landed in its site-packages. Slow (a build and a venv): one test.
"""

from __future__ import annotations

import subprocess
import sys
import venv
from pathlib import Path

import tomllib

from capture_plan.planner.inputs import resources

ROOT = Path(__file__).resolve().parent.parent


def test_the_wheel_installs_one_top_level_package(tmp_path, monkeypatch):
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(wheels), str(ROOT)],
        check=True,
        capture_output=True,
        cwd=tmp_path,
    )
    (wheel,) = wheels.glob("capture_plan-*.whl")
    env = tmp_path / "env"
    venv.create(env, with_pip=False)
    python = env / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    before = set(p.name for p in Path(site).iterdir())
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", str(wheel)],
        check=True,
        capture_output=True,
    )
    added = sorted(set(p.name for p in Path(site).iterdir()) - before)
    assert [n for n in added if not n.endswith(".dist-info")] == ["capture_plan"], added
    pkg = Path(site) / "capture_plan"
    assert sorted(p.name for p in pkg.iterdir() if p.is_dir() and p.name != "__pycache__") == [
        "adapters",
        "executor",
        "planner",
        "references",
        "schemas",
    ]
    # every subpackage of the checkout is installed (capture_plan.planner.fit was missing from
    # pyproject.toml's packages: `planner fit` ended in ModuleNotFoundError in an installed copy)
    for top in ("schemas", "planner", "executor", "adapters", "references"):
        for init in (ROOT / top).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT)
            assert (pkg / rel / "__init__.py").exists(), f"{rel} is not in pyproject.toml's [tool.setuptools] packages"
    # the executor package ships the executor only: the reference models live beside it
    assert not list((pkg / "executor").glob("reference*.py")) and not (pkg / "executor" / "speculative.py").exists()
    assert (pkg / "planner" / "data" / "rules.toml").exists() and (pkg / "py.typed").exists()
    # the root's modules: the package's own, not the build script (importing it would run a build)
    assert sorted(p.name for p in pkg.glob("*.py")) == ["__init__.py"]
    # the root package imports from the install (no dependency needed for it), away from the checkout
    code = "import capture_plan; print(capture_plan.__version__, capture_plan.__file__)"
    r = subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=True, cwd=tmp_path)
    version, path = r.stdout.split()
    assert Path(path).parent == pkg and version == wheel.name.split("-")[1]
    assert (env / "bin" / "planner").exists()
    (info,) = [n for n in added if n.endswith(".dist-info")]
    entry = [ln for ln in (Path(site) / info / "entry_points.txt").read_text().splitlines() if ln.startswith("planner")]
    assert entry == ["planner = capture_plan.planner.cli:script"]
    # `pip install '.[executor]'` brings numpy: torch's wheels do not, and torch warns without it
    requires = [
        ln for ln in (Path(site) / info / "METADATA").read_text().splitlines() if ln.startswith("Requires-Dist:")
    ]
    executor = sorted(ln.split()[1].split(";")[0].split(">")[0] for ln in requires if 'extra == "executor"' in ln)
    assert executor == ["numpy", "torch", "tqdm"], requires
    # each data file parsed at build time (setup.py): the copy the installed planner reads
    # is tomllib's parse of the file beside it (planner/inputs/resources.py's parsed_at_install)
    data = pkg / "planner" / "data"
    tomls = sorted(data.glob("*.toml"))
    assert tomls and sorted(p.name for p in data.glob("*" + resources.PARSED_SUFFIX)) == [
        p.name + resources.PARSED_SUFFIX for p in tomls
    ]
    # and each engine release's file (planner/data/releases/), every one the checkout has
    releases = sorted(data.glob("releases/*.toml"))
    assert [p.name for p in releases] == sorted(p.name for p in (ROOT / "planner/data/releases").glob("*.toml"))
    assert all(p.with_name(p.name + resources.PARSED_SUFFIX).is_file() for p in releases)
    monkeypatch.setattr(resources, "_DATA", data)
    for toml in tomls + releases:
        name = str(toml.relative_to(data))
        assert resources.parsed_at_install(name, toml.read_bytes()) == tomllib.loads(toml.read_text()), name
