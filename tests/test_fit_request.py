"""fit's request travels whole (issue 50): :class:`FitRequest` made once by its caller,
changed by a refusal's or a fix's changes (:meth:`FitRequest.changed`), a verified fix read
back as typed changes (:func:`.flags.changes_of`), and the fixes fit keeps are the ones that
fit once applied."""

from __future__ import annotations

from pathlib import Path

import pytest

from capture_plan.planner.fit.fit import FitRequest, fit
from capture_plan.planner.fit.flags import changes_of
from capture_plan.planner.fit.model import load_model

ROOT = Path(__file__).resolve().parent.parent
LLAMA = load_model(str(ROOT / "planner/data/configs/llama-3.1-8b.json"))


def test_a_fix_reads_back_as_typed_changes():
    """Each value of its flag's type (tp an integer); a switch alone is True."""
    assert changes_of("--max-model-len 6912") == {"max-model-len": 6912}
    assert changes_of("--tp 2") == {"tp": 2}
    assert changes_of("--mem-fraction-static 0.78 --cuda-graph-max-bs 128") == {
        "mem-fraction-static": 0.78,
        "cuda-graph-max-bs": 128,
    }
    assert changes_of("--kv-cache-dtype fp8") == {"kv-cache-dtype": "fp8"}
    assert changes_of("--enforce-eager --max-num-seqs 128") == {"enforce-eager": True, "max-num-seqs": 128}
    assert changes_of("--swa-full-tokens-ratio 0.9 --disable-hybrid-swa-memory") == {
        "swa-full-tokens-ratio": 0.9,
        "disable-hybrid-swa-memory": True,
    }
    assert changes_of("--disable-hybrid-swa-memory --page-size 16") == {
        "disable-hybrid-swa-memory": True,
        "page-size": 16,
    }


def test_a_change_applies_to_the_request():
    """A flag replaced or left out (None), tp and the device changed; a new engine keeps only
    the flags it has (SGLang's are no vLLM flags); the request itself is left as it was."""
    req = FitRequest(LLAMA, "H100", "vllm==0.34.0", 1, {"max-model-len": 8192, "block-size": 16, "x": None})
    got = req.changed({"max-model-len": 4096, "block-size": None, "tp": "2", "device": "H200"})
    assert (got.flags, got.tp, got.device, got.engine) == ({"max-model-len": 4096}, 2, "H200", "vllm==0.34.0")
    assert req.flags == {"max-model-len": 8192, "block-size": 16, "x": None} and req.tp == 1
    sgl = req.changed({"engine": "sglang==0.5.23", "context-length": 8192})
    assert sgl.engine == "sglang==0.5.23" and sgl.flags == {"context-length": 8192}


@pytest.mark.parametrize("engine,flag", [("vllm==0.34.0", "max-model-len"), ("sglang==0.5.23", "context-length")])
def test_the_fixes_fit_keeps_each_fit_once_applied(engine, flag):
    """A context longer than the cache holds on an RTX 4090: each fix fit keeps, applied to the
    request, fits."""
    req = FitRequest(LLAMA, "RTX 4090", engine, 1, {flag: 131072})
    res = fit(req)
    assert not res.fits and res.fixes
    for fix in res.fixes:
        assert fit(req.changed(changes_of(fix))).fits, fix
