"""The product's modules stay small enough to read whole: none over 600 lines (issue 39).

A module that grows past it is split by concern (docs/development.md's layout names each
module's job), not trimmed; tests, benches and docs are not product code."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: the product's top-level folders (the package's subpackages); tests/, bench/, docs/ are not
PRODUCT = ("schemas", "planner", "executor", "adapters", "references")
MAX_LINES = 600


def test_no_product_module_is_over_600_lines():
    long = {
        str(p.relative_to(ROOT)): n
        for folder in PRODUCT
        for p in sorted((ROOT / folder).rglob("*.py"))
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"over {MAX_LINES} lines (split by concern): {long}"
