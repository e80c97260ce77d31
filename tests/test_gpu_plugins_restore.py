"""The plugins' start-up from a graph file on a GPU (marked ``gpu``; skipped where CUDA is absent):
an engine-faithful runner routed by its plugin with ``CAPTURE_PLAN_GRAPHS`` set writes the file
in one process (no file yet: captured through the plan), and a fresh process that allocated
1 GiB first (so that its model, workspaces and pools lie elsewhere) restores every graph from
it instead of capturing; every graph the engine keeps then replays bit for bit as the saving
process's captured graph did on the same inputs, and as the eager forward (to float tolerance).
tests/plugins_fresh.py runs both processes. The same start-ups on the CPU, fakes throughout:
tests/test_plugins_restore.py.

Run on the device: ``python -m pytest -m gpu -q tests/test_gpu_plugins_restore.py``.
"""

from __future__ import annotations

import pytest

from fresh_process import fresh_result

pytestmark = pytest.mark.gpu


def _fresh(*args: str) -> dict:
    return fresh_result("plugins_fresh.py", *args, timeout=240)


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_an_engine_restores_the_graphs_its_last_start_up_wrote_bit_for_bit(tmp_path, engine):
    saved = _fresh("save", engine, str(tmp_path))
    print(f"{engine} save: {saved['line']}")
    assert saved["outcome"] == "captured" and saved["saved"] and saved["warnings"] == [], saved
    assert (tmp_path / "graphs.cpgraphs").is_file()
    got = _fresh("restore", engine, str(tmp_path), "1024")
    r = got["report"]
    print(f"{engine} restore: {got['line']}; loading runs at {r['keys']}")
    assert got["outcome"] == "restored" and got["warnings"] == [], got
    assert got["graphs"] == saved["graphs"] > 0 and r["graphs"] == saved["graphs"] and r["nodes"] > 0
    # every segment the graphs point into lies elsewhere than in the saving process
    assert r["segments"] > 0 and r["moved"] == r["segments"], r
    # every graph the engine keeps replays as the saving process's captured one, bit for bit
    assert got["differ"] == [] and len(got["equal"]) == got["graphs"], got
    assert len(got["eager_close"]) == got["graphs"], got
