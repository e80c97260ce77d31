"""Every bench that builds a model sizes its KV cache for the device it runs on, or skips
the case saying why (issue 49, item 7: "A bench sizes itself for the device it runs on, or
skips a case with its reason").

The benches that built their model directly (speculative_bench, capture_bench, cold_stream,
startup_bench: ``ReferenceModel``/``SpeculativeModel`` at 512 tokens a slot; models_bench:
``HFTarget`` at 256) kept that cache whatever the device. At their default sizes (256
slots, 32 layers: 16-18 GiB of cache beside 16 GiB of weights) that fits an H100 80GB, but
a smaller card, or a larger ``--bs`` or ``--layers``, ended in an out-of-memory traceback.
Each now takes its model from ``bench.harness.case_target`` (the one owner of the sizing)
through its own ``build_target``. Here the free memory is a given figure
(``bench.harness.free_bytes`` faked) and the model classes record the configuration they
are given: no GPU.
"""

from __future__ import annotations

import pytest

from bench_modules import ROOT, bench_module

GIB = 1 << 30
#: free memory before a model is built: an H100 80GB (79.19 GiB in all) and an H200
H100_FREE = int(78.6 * GIB)
H200_FREE = int(138.5 * GIB)

h = bench_module("harness")


@pytest.fixture
def device(monkeypatch):
    """``set_free(bytes)`` fakes the device's free memory; the reference models record their
    config instead of allocating."""
    pytest.importorskip("torch")
    import capture_plan.references.decode as decode
    import capture_plan.references.speculative as speculative

    class Recorded:
        def __init__(self, cfg, *args, **kw):
            self.cfg = cfg

    monkeypatch.setattr(decode, "ReferenceModel", Recorded)
    monkeypatch.setattr(speculative, "SpeculativeModel", Recorded)

    def set_free(n: int) -> None:
        monkeypatch.setattr(h, "free_bytes", lambda: n)

    return set_free


def kv_bytes(slots: int, layers: int, seqlen: int, kv_heads: int = 8, head_dim: int = 128) -> int:
    """The bf16 K and V caches the reference models allocate: one row of ``seqlen`` tokens
    per slot and layer (``k_cache``/``v_cache`` of shape (slots, seqlen, kv_heads, head_dim))."""
    return 2 * slots * layers * seqlen * kv_heads * head_dim * 2


def plan(name: str):
    from capture_plan.executor import load_plan

    return load_plan(ROOT / "plans" / name, check_env=False)  # a CPU here, an sm90 plan


def test_the_speculative_bench_sizes_its_eagle_target_from_the_free_memory(device):
    """speculative_bench built ``SpeculativeModel`` at 512 tokens for every slot whatever the
    device. Its target is now the harness's "eagle" case: 512 tokens where they fit (an H200,
    and an H100: 257 slots x 33 layers, 17.8 GiB), the longest cache that fits KV_SHARE of
    the free memory on a smaller card, and where not even the longest phase fits, no model
    and the reason (the planted-bug parts, a small model of their own, still run)."""
    sb = bench_module("speculative_bench")
    ci = plan("fa3-eagle-ci.json")
    slots = max(max(p.sizes) for p in ci.phases) + 1  # SpeculativeModel's padding row
    for free in (H200_FREE, H100_FREE):
        device(free)
        model, why = sb.build_target(ci, 32)
        assert why is None and model.cfg.max_seqlen == 512 and model.cfg.max_bs == slots - 1 == 256
        assert (model.cfg.num_steps, model.cfg.topk, model.cfg.draft_layers) == (3, 1, 1)
    device(20 * GIB)  # a 24 GB card
    model, why = sb.build_target(ci, 32)
    seqlen = model.cfg.max_seqlen
    assert why is None and 4 < seqlen < 512
    assert kv_bytes(slots, 33, seqlen) <= 20 * GIB * h.KV_SHARE < kv_bytes(slots, 33, seqlen + 1)
    device(GIB // 8)
    model, why = sb.build_target(ci, 32)
    assert model is None
    assert why.startswith(
        "eagle does not fit this device: bench.harness.case_target: its KV cache (257 slots x 33 layers) needs "
    )
    assert why.endswith("fix: run it on a device with more memory, or with fewer layers (--layers)")


@pytest.mark.parametrize("bench", ["capture_bench", "cold_stream", "startup_bench"])
def test_a_reference_bench_sizes_its_cache_from_the_free_memory(device, bench):
    """capture_bench, cold_stream and startup_bench built ``ReferenceModel`` at 512 tokens for
    256 slots whatever the device. Each now keeps 512 where it fits (an H100 too: 16 GiB at
    32 layers), shortens the cache on a smaller device, and skips with the reason where not
    even the verify phase's 4 tokens fit."""
    module = bench_module(bench)
    build = {
        "capture_bench": lambda: module.build_target(plan("fa3-ci.json"), 32),
        "cold_stream": lambda: module.build_target(32, 256),
        "startup_bench": lambda: module.build_target(32),
    }[bench]
    for free in (H200_FREE, H100_FREE):
        device(free)
        model, why = build()
        assert why is None and model.cfg.max_seqlen == 512 and model.cfg.max_bs == 256
        assert model.cfg.model.layers == 32
    device(20 * GIB)  # a 24 GB card: 12 GiB of cache
    model, _ = build()
    assert model.cfg.max_seqlen == 384 == int(20 * GIB * h.KV_SHARE) // kv_bytes(256, 32, 1)
    device(100 * 2**20)
    model, why = build()
    assert model is None and why.startswith("reference does not fit this device: ")
    assert "needs 160 MiB at the shortest cache (5 tokens); 60% of the device's free memory is 60 MiB" in why


@pytest.fixture
def hf_device(device, monkeypatch):
    """``device`` for the transformers cases: the model is not built, ``HFTarget`` records
    its keyword arguments."""
    transformers = pytest.importorskip("transformers")
    import capture_plan.adapters.hf as hf

    class Model:
        def to(self, **kw):
            return self

        def eval(self):
            return self

    class Target:
        def __init__(self, model, **kw):
            self.model, self.kw = model, kw
            self.max_seqlen = kw["max_seqlen"]

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_config", lambda cfg: Model())
    monkeypatch.setattr(hf, "HFTarget", Target)
    return device


def test_the_models_bench_sizes_each_architecture_from_the_free_memory(hf_device):
    """models_bench built ``HFTarget`` at 256 tokens whatever the device; it now takes the
    harness's case: HF_MAX_SEQLEN where it fits, shorter where not, skipped with the reason
    where not even one token of context fits (llama: 8 MiB of cache a token at 256 slots)."""
    mb = bench_module("models_bench")
    hf_device(H100_FREE)
    target, why = mb.build_target("llama", 256)
    assert why is None and target.kw == {
        "max_bs": 256,
        "max_seqlen": h.HF_MAX_SEQLEN,
        "attention": "model",
        "fa3_splits": 0,
    }
    hf_device(GIB)
    target, _ = mb.build_target("llama", 256)
    per_token = 2 * 256 * 8 * 8 * 128 * 2  # K and V, 8 layers, 8 KV heads of 128, bf16
    assert target.max_seqlen == int(GIB * h.KV_SHARE) // per_token == 76
    hf_device(16 * 2**20)
    target, why = mb.build_target("llama", 256)
    assert target is None and why.startswith("llama does not fit this device: ")
    assert why.endswith("; fix: run it on a device with more memory")  # models_bench has no --layers


def test_a_skipped_architecture_is_a_row_of_the_table_with_its_reason():
    """models_bench's table and summary name a skipped architecture and why, and count it
    as not run."""
    pytest.importorskip("torch")
    mb = bench_module("models_bench")
    row = mb.table({"llama": {"skipped": "llama does not fit this device: needs 16 MiB"}})
    assert row.splitlines()[-1] == "| llama | skipped: llama does not fit this device: needs 16 MiB | | | | | |"


@pytest.mark.parametrize("case", sorted(h.HF_ARCHS))
def test_the_transformers_cache_shape_is_what_hftarget_allocates(case):
    """The harness sizes a transformers case from its config (``hf_kv_shape``): the bytes it
    counts are the bytes of the static cache ``HFTarget`` allocates, for every architecture
    (MLA's one-head latent included), here on the CPU with 2 layers and 3 slots of 8."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from capture_plan.adapters.hf import HFTarget

    cfg = h.hf_config(case, num_hidden_layers=2, vocab_size=128)
    cfg._attn_implementation = h.HF_ARCHS[case][2]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(dtype=torch.bfloat16).eval()
    target = HFTarget(model, max_bs=3, max_seqlen=8)
    allocated = sum(t.numel() * t.element_size() for layer in target.cache.layers for t in (layer.keys, layer.values))
    shape = h.hf_kv_shape(cfg)
    assert allocated == 3 * 8 * shape["layers"] * shape["kv_heads"] * (shape["head_dim"] + shape["value_dim"]) * 2
    budget = allocated + 5  # exactly 8 tokens fit, not 9
    assert h.fit_seqlen(budget=budget, slots=3, longest=1, most=h.HF_MAX_SEQLEN, **shape) == 8


def test_a_skipped_bench_prints_a_summary_line_with_its_reason():
    """The lead's smoke run reads one SUMMARY line per bench: a run whose model does not fit
    says so on it; speculative_bench's line also stands for a run of some parts only."""
    pytest.importorskip("torch")
    why = "eagle does not fit this device: here: its KV cache needs 9 MiB; fix: a larger device"
    sb = bench_module("speculative_bench")
    wild = {"4": {"exit": 3, "line": "the CUDA context is lost; rerun under compute-sanitizer"}}
    assert sb.summary({"skipped": why, "bugs": {}, "wild": wild}) == (
        f"SUMMARY target SKIPPED ({why}); bugs: faults by check {{}}; wild named 1/1"
    )
    loop = {"pool_mib": 1700.4, "oom_at": None, "graphs": 177, "capture_s": 9.5, "replays_not_equal_eager": 0}
    assert sb.summary({"max_seqlen": 340, "floors_mib": {"a": 1000.0, "b": 200.0}, "loop": loop}) == (
        "SUMMARY target max_seqlen 340; floors 1200 MiB; loop pool 1700 MiB (oom at None), 177 graphs in 9.50 s, "
        "replays bad 0"
    )
    cs = bench_module("cold_stream")
    assert cs.summary({"skipped": why}) == f"SUMMARY SKIPPED: {why}"
    warm = {"pool_mib": 10.0, "persistent_blocks": []}
    cold = {"pool_mib": 42.0, "persistent_blocks": [32 * 2**20]}
    assert cs.summary({"bs": 64, "max_seqlen": 512, "warm_stream": warm, "cold_stream": cold}) == (
        "SUMMARY bs 64 max_seqlen 512: pool warm stream 10.0 MiB, cold stream 42.0 MiB (+32.0); blocks alive "
        "beyond the output: warm 0 (0.0 MiB), cold 1 (32.0 MiB)"
    )


# -- the benches that run each case in a child process (their model is case_target's) ------------


CHILDREN = {
    "graph_exec_bench": lambda m: m.child("reference"),
    "adoption_bench": lambda m: m.child("reference"),
    "copies_bench": lambda m: m.child("reference", "in-turn"),
    "restore_floor": lambda m: m.child("reference", 32, False),
}


@pytest.mark.parametrize("bench", sorted(CHILDREN))
def test_a_case_that_does_not_fit_is_skipped_by_its_child_with_the_reason(device, bench):
    """graph_exec_bench, adoption_bench, copies_bench and restore_floor sized their models
    through case_target, but a case that did not fit ended its child process with exit 1:
    the parent printed it as FAILED (restore_floor then exited 1), as if the bench were
    broken. The child now returns the case as skipped, with the reason."""
    device(0)
    got = CHILDREN[bench](bench_module(bench))
    assert got["skipped"].startswith("reference does not fit this device: bench.harness.case_target: its KV cache")
    assert "60% of the device's free memory is 0 MiB" in got["skipped"]


def test_restore_floors_fresh_processes_skip_a_case_that_does_not_fit(device, tmp_path):
    """``restore_floor --fresh``: the capture side builds the plan, then skips the case saying
    why; the summary names it, not a failure."""
    device(0)
    rf = bench_module("restore_floor")
    got = rf.fresh_child("reference", 32, "capture", tmp_path)
    assert got["skipped"].startswith("reference does not fit this device: bench.harness.case_target: its KV cache")
    assert (tmp_path / "plan.json").exists()
    line = rf.fresh_summary({"cases": {"reference": {"capture": got}}})
    assert line == f"SUMMARY restore fresh (from weights loaded to graphs ready): reference SKIPPED: {got['skipped']}"


def test_restore_floors_fresh_summary_puts_the_restore_against_the_capture():
    rf = bench_module("restore_floor")
    save = {"bytes": 32 * 2**20, "modules": 12, "functions": 150}
    capture = {"seconds": 4.0, "graphs": 36, "captured_equal": ["decode/1"] * 36, "save": save}
    parts = {"load": 1.5, "load.functions": 0.125, "rebuild": 1.25, "environment": 0.25, "check": 0.5}
    restore = dict(seconds=3.0, parts=parts, keys=["decode/256", "decode/1"], graphs=36, functions=150, attributes=3)
    restore.update(equal=["decode/1"] * 35, differ=["decode/8"], segments=130, moved=130)
    refused = {"refused": "x", "reasons": ["driver differs: ..."]}
    cases = {"reference": {"capture": capture, "restore": restore}, "eagle": {"capture": capture, "restore": refused}}
    line = rf.fresh_summary({"cases": cases})
    assert line == (
        "SUMMARY restore fresh (from weights loaded to graphs ready): reference capture 4.000 s, restore 3.000 s "
        "(0.75x; loading 1.500 s: runs at 2 keys for 12 modules, 150 kernels fetched by name (0.125 s, 3 attributes "
        "set); environment 0.250 s, check 0.500 s; rebuild 1.250 s), bit-equal 35/36 (captured 36/36), moved 130/130 "
        "segments, file 32.0 MiB; eagle REFUSED: driver differs: ..."
    )
    restore["builder"] = "compiled"  # runs from the compiled graph builder on name it
    assert "rebuild 1.250 s by the compiled graph builder), bit-equal" in rf.fresh_summary({"cases": cases})


def test_the_child_benches_summaries_name_a_skipped_case_and_why():
    """Each parent's SUMMARY line names a skipped case and its reason; restore_floor counts
    it as skipped, not failed (its exit status stays 0)."""
    pytest.importorskip("torch")
    why = "eagle does not fit this device: here: its KV cache needs 9 MiB; fix: a larger device"
    ge = bench_module("graph_exec_bench").summary({"cases": {"eagle": {"case": "eagle", "skipped": why}}})
    assert ge == f"SUMMARY no case counted nodes; eagle SKIPPED: {why}"
    rows = bench_module("adoption_bench").case_rows({"eagle": {"skipped": why}})
    assert rows == [f"eagle: SKIPPED: {why}"]
    cb = bench_module("copies_bench").summary("eagle", {"in-turn": [{"skipped": why}], "side-by-side": []})
    assert cb == f"eagle: SKIPPED: {why}"
    rf = bench_module("restore_floor").summary({"cases": {"eagle": {"case": "eagle", "skipped": why}}})
    assert rf == f"SUMMARY restore floor (pool/other-torch/outside): eagle SKIPPED: {why}"


def test_docs_restore_fresh_table_reads_what_the_fresh_bench_writes(tmp_path, monkeypatch):
    """docs/generate.py's restore-fresh table over a run as ``restore_floor --fresh`` writes it:
    a restored case, a refused one, one skipped (no committed run yet to render from)."""
    import json

    from test_doc_figures import gen

    capture = {"seconds": 4.0, "graphs": 36, "captured_equal": ["d/1"] * 36, "save": {"bytes": 32 * 2**20}}
    restore = dict(seconds=3.0, parts={"load": 1.5, "rebuild": 1.25}, keys=["d/256", "d/1"], graphs=36)
    restore.update(equal=["d/1"] * 36, differ=[], segments=130, moved=130)
    run = {"date": "2026-12-07T00:00:00", "device": "NVIDIA H100 80GB HBM3", "torch": "2.11.0", "commit": "abc"}
    run["cases"] = {
        "reference": {"capture": capture, "restore": restore},
        "eagle": {"capture": capture, "restore": {"refused": "x", "reasons": ["driver differs"]}},
        "llama": {"capture": {"case": "llama", "skipped": "llama does not fit this device"}},
    }
    (tmp_path / "restore-fresh-2026-12-07-t.json").write_text(json.dumps(run))
    monkeypatch.setattr(gen, "RESULTS", tmp_path)
    monkeypatch.setattr(gen, "RESTORE_FRESH_RUNS", ["restore-fresh-2026-12-07-t.json"])
    lines = gen.restore_fresh()
    assert lines[2] == (
        "| reference (2026-12-07-t) | 4.000 | 3.000 | 0.75x | 1.500 (2 keys) / 1.250 | 36/36 (captured 36/36) "
        "| 130/130 | 32.0 |"
    )
    assert lines[3] == "| eagle (2026-12-07-t) | 4.000 | refused: driver differs |  |  |  |  | 32.0 |"
    assert lines[4] == "| llama (2026-12-07-t) | llama does not fit this device |  |  |  |  |  |  |"
    assert lines[-1].startswith("Source: `bench/results/restore-fresh-2026-12-07-t.json` (NVIDIA H100")
