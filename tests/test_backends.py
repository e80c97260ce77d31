"""Backends are typed data: a new one is a table in backends.toml and nothing else."""

from __future__ import annotations

import functools

import pytest

from capture_plan.planner import BuildOptions, build_plan
from capture_plan.planner.inputs import resources
from capture_plan.schemas.errors import InputError

NEW = b"""
[backends.newattn]
description = "a backend added by data alone"
modules = ["newattn_kernels"]
min_compute_capability = [8, 9]
workspace = { name = "meta", elem_bytes = 4, per_request = 2, fixed = 3, round_batch_to = 8 }
lse = true
attention_temp_factor = 2.0
"""


@pytest.fixture
def backends_toml(data_file):
    """Replace backends.toml's bytes with the shipped ones plus ``extra``."""
    return functools.partial(data_file, "backends.toml")


def test_a_backend_added_by_a_data_file_alone_builds_and_is_offered(backends_toml, cli):
    backends_toml(NEW)
    plan = build_plan(BuildOptions(backend="newattn"))
    assert plan.requires.modules == ["newattn_kernels"] and plan.requires.min_compute_capability == [8, 9]
    assert plan.predicted.pool_bytes > 0
    # its workspace is hoistable like FA3's: 4 * (2 * round_up(256, 8) + 3) bytes at the largest size
    pinned = build_plan(BuildOptions(backend="newattn", strategies=("workspace=hoisted",)))
    assert pinned.predicted.hoisted_bytes == 4 * (2 * 256 + 3)
    assert "newattn" in resources.backend_names()
    from capture_plan.planner.cli._build_inputs import complete_backend as _complete_backend

    assert _complete_backend("new") == ["newattn"]


def test_an_unknown_key_in_a_backend_table_names_file_and_key(backends_toml):
    backends_toml(NEW.replace(b"lse = true", b"lse = true\nsplits = 8"))
    with pytest.raises(InputError, match=r"planner/data/backends.toml: \$\.backends\.newattn.*splits"):
        build_plan(BuildOptions(backend="newattn"))
