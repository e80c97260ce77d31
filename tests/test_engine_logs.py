"""Published engine start-up logs (tests/data/engine_logs): every fixture is well-formed.

The fixtures are what `planner fit` is checked against (issue 52, item 6): real
start-up logs that deployments published, each with its URL, the engine
release, the device, the model's config.json and the settings it shows. This
file checks only their form, so that a fixture the fit test reads is one a
reader can trace back: every required field is there, the config file exists
and parses with the fields a memory planner needs, every number under
``[logged]`` appears verbatim in the quoted log lines (integers also in the
engine's thousands-separated form, ``46,368``), the URL is https on GitHub or
on a page named in ``PUBLISHED_PAGE_HOSTS``, and the version parses as a
release. Fit's accuracy against these logs is tested elsewhere.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from urllib.parse import urlparse

import pytest
from packaging.version import InvalidVersion, Version

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

LOGS = Path(__file__).parent / "data" / "engine_logs"
ENGINES = ("vllm", "sglang")
REQUIRED = {
    "url": str,
    "engine": str,
    "version": str,
    "device": str,
    "model": str,
    "config": str,
    "tp": int,
    "notes": str,
    "settings": dict,
    "logged": dict,
}
# The fields a memory planner reads from every config (MoE, MLA, sliding-window and
# quantization fields are checked only where a model has them: not every model does).
CONFIG_FIELDS = (
    "architectures",
    "model_type",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
    "max_position_embeddings",
)
# Non-GitHub pages a fixture may cite: each one is a published log named in the
# folder's README. GitHub (issues, pull requests, docs in repositories) needs no entry.
PUBLISHED_PAGE_HOSTS = frozenset({"myoceane.fr"})


def fixture_problems(path: Path) -> list[str]:
    """What is wrong with one fixture file (empty: well-formed)."""
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        return [f"not TOML: {exc}"]
    problems = [
        f"{key}: missing or not {kind.__name__}"
        for key, kind in REQUIRED.items()
        if not isinstance(data.get(key), kind) or (kind is int and isinstance(data.get(key), bool))
    ]
    if problems:
        return problems
    url = urlparse(data["url"])
    if url.scheme != "https" or not (url.hostname == "github.com" or url.hostname in PUBLISHED_PAGE_HOSTS):
        problems.append(f"url: {data['url']!r} is not https on github.com or a page in PUBLISHED_PAGE_HOSTS")
    if data["engine"] not in ENGINES:
        problems.append(f"engine: {data['engine']!r} is not one of {ENGINES}")
    try:
        Version(data["version"])
    except InvalidVersion:
        problems.append(f"version: {data['version']!r} is not a release version")
    if data["tp"] < 1:
        problems.append(f"tp: {data['tp']} < 1")
    if not data["notes"].strip():
        problems.append("notes: empty")
    problems += _config_problems(path.parent / data["config"])
    problems += _logged_problems(data["logged"])
    return problems


def _config_problems(config: Path) -> list[str]:
    if not config.is_file():
        return [f"config: {config} does not exist"]
    try:
        fields = json.loads(config.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        return [f"config: {config.name} is not JSON: {exc}"]
    if not isinstance(fields, dict):
        return [f"config: {config.name} is not a JSON object"]
    return [f"config: {config.name} lacks {field}" for field in CONFIG_FIELDS if field not in fields]


def _logged_problems(logged: dict) -> list[str]:
    quote = logged.get("quote")
    if not isinstance(quote, str) or not quote.strip():
        return ["logged.quote: missing or empty"]
    numbers = {key: value for key, value in logged.items() if key != "quote"}
    problems = [
        f"logged.{key}: {value!r} is not a number"
        for key, value in numbers.items()
        if isinstance(value, bool) or not isinstance(value, (int, float))
    ]
    if not numbers:
        problems.append("logged: no figure besides the quote")
    for key, value in numbers.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool) and not _quoted(value, quote):
            problems.append(f"logged.{key}: {value!r} does not appear in the quote")
    return problems


def _quoted(value: float, quote: str) -> bool:
    """The number as the engine printed it: a whole token, not a part of a longer number."""
    forms = {str(value)}
    if isinstance(value, int):
        forms.add(f"{value:,}")
    return any(re.search(rf"(?<![\d.,]){re.escape(form)}(?![\d]|[.,]\d)", quote) for form in forms)


FIXTURES = sorted(LOGS.glob("*.toml"))


def test_the_folder_holds_logs():
    # the fit engineer's accuracy test reads this folder: an empty glob would pass vacuously
    assert len(FIXTURES) >= 7, FIXTURES


@pytest.mark.parametrize("path", FIXTURES, ids=lambda p: p.stem)
def test_fixture_is_well_formed(path: Path):
    assert fixture_problems(path) == []


def test_every_config_is_sourced_and_used():
    """Each config names its source in configs/README.md, and each one is read by a log."""
    readme = (LOGS / "configs" / "README.md").read_text(encoding="utf-8")
    used = {tomllib.loads(p.read_text(encoding="utf-8"))["config"] for p in FIXTURES}
    for config in sorted((LOGS / "configs").glob("*.json")):
        assert f"`{config.name}`" in readme, f"{config.name} has no source line in configs/README.md"
        assert f"configs/{config.name}" in used, f"{config.name} is read by no log"


def test_every_log_is_in_the_readme_table():
    readme = (LOGS / "README.md").read_text(encoding="utf-8")
    for path in FIXTURES:
        assert f"`{path.name}`" in readme, f"{path.name} is not in README.md's table"


GOOD = """\
url = "https://github.com/vllm-project/vllm/issues/1"
engine = "vllm"
version = "0.21.0"
device = "NVIDIA H100 80GB HBM3"
model = "Qwen/Qwen3-8B"
config = "configs/qwen3-8b.json"
tp = 1
notes = "test case"
[settings]
max-model-len = 16384
[logged]
kv_tokens = 46368
kv_cache_gib = 6.37
quote = \"\"\"
Available KV cache memory: 6.37 GiB
GPU KV cache size: 46,368 tokens
\"\"\"
"""

MALFORMED = {
    "number not in the quote": (GOOD.replace("kv_tokens = 46368", "kv_tokens = 46369"), "kv_tokens"),
    "a part of a longer number": (GOOD.replace("kv_cache_gib = 6.37", "kv_cache_gib = 6.3"), "kv_cache_gib"),
    "missing config file": (GOOD.replace("qwen3-8b.json", "no-such.json"), "does not exist"),
    "http url": (GOOD.replace("https://github.com", "http://github.com"), "url"),
    "url off GitHub": (GOOD.replace("https://github.com", "https://example.com"), "url"),
    "unparsable version": (GOOD.replace('"0.21.0"', '"latest"'), "version"),
    "unknown engine": (GOOD.replace('engine = "vllm"', 'engine = "tgi"'), "engine"),
    "missing device": (GOOD.replace('device = "NVIDIA H100 80GB HBM3"\n', ""), "device"),
    "tp as a string": (GOOD.replace("tp = 1", 'tp = "1"'), "tp"),
    "no quote": (GOOD[: GOOD.index("quote =")], "quote"),
    "not TOML": ("url = \n", "not TOML"),
}


def _write_case(tmp_path: Path, text: str) -> Path:
    configs = tmp_path / "configs"
    configs.mkdir()
    (configs / "qwen3-8b.json").write_bytes((LOGS / "configs" / "qwen3-8b.json").read_bytes())
    path = tmp_path / "case.toml"
    path.write_text(text, encoding="utf-8")
    return path


def test_a_good_fixture_passes(tmp_path: Path):
    # the malformed cases below differ from this one in one line each
    assert fixture_problems(_write_case(tmp_path, GOOD)) == []


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_fixture_fails(tmp_path: Path, case: str):
    text, expected = MALFORMED[case]
    problems = fixture_problems(_write_case(tmp_path, text))
    assert problems, case
    assert any(expected in problem for problem in problems), problems


def test_a_config_without_planner_fields_fails(tmp_path: Path):
    path = _write_case(tmp_path, GOOD)
    (tmp_path / "configs" / "qwen3-8b.json").write_text('{"model_type": "qwen3"}', encoding="utf-8")
    assert "config: qwen3-8b.json lacks num_key_value_heads" in fixture_problems(path)
