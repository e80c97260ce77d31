"""bench/fit_bench.py's parts on the CPU (issue 52, item 6): the settings both sides are
given, fit's side for every case's model (the spec reading and the model families), the
comparison against the issue's targets, the runner's start-up on a case model with CUDA
faked (the dummy runs through the model's profiling forward, the decode graphs captured,
the decode cache counted as committed KV), the rule on the runner's measured items, the
row's JSON and its SUMMARY line. The GPU run is ``python -m bench.fit_bench`` (and
tests/test_gpu_fit_bench.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench_modules import bench_module

fb = bench_module("fit_bench")
MIB, GIB = 1 << 20, 1 << 30
H100, H200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"


def test_the_llama_case_runs_past_its_context_as_the_engines_do_under_their_variables(tmp_path):
    """bench/fit_bench.py gives every case max-model-len 4096 (MAX_MODEL_LEN), past the llama
    case's max_position_embeddings 2048: vLLM and SGLang refuse that at start unless their
    variables allow it, and so does fit (planner/fit/context.py). The bench runs fit under them
    (long_context), as the engines would run, and leaves the process's environment as it was."""
    import os

    assert "VLLM_ALLOW_LONG_MAX_MODEL_LEN" not in os.environ
    with fb.long_context():
        assert os.environ["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] == "1"
    assert "VLLM_ALLOW_LONG_MAX_MODEL_LEN" not in os.environ


@pytest.mark.parametrize("device", [H100, H200])
@pytest.mark.parametrize("release, utilization", [("vllm==0.34.0", 1.0), ("vllm==0.33.0", 0.92)])
def test_the_settings_are_the_releases_defaults_for_the_device_and_fit_runs_with_them(
    device, release, utilization, tmp_path
):
    """vLLM 0.34.0 on an H100 or H200: utilization 1.0 (the extensible KV cache's; 0.33.0's
    0.92), 1024 sequences, 8192 batched tokens, its 51 default sizes up to 512; fit's result
    echoes every setting the runner was given, under vLLM's flag names."""
    pytest.importorskip("transformers")
    s = fb.settings_for(device, release)
    assert (s.gpu_memory_utilization, s.max_num_seqs, s.max_num_batched_tokens) == (utilization, 1024, 8192)
    assert s.capture_sizes == (1, 2, 4, *range(8, 256, 8), *range(256, 513, 16))
    got = fb.fit_side("llama", tmp_path, 32, device, s, release)["default"]["settings"]
    flags = fb.fit_flags(s)
    assert got["cudagraph-capture-sizes"] == ",".join(map(str, s.capture_sizes))
    for name in ("gpu-memory-utilization", "max-model-len", "max-num-seqs", "max-num-batched-tokens", "block-size"):
        assert got[name] == flags[name], name
    assert got["cudagraph-mode"] == "FULL_DECODE_ONLY" and got["kv-cache-dtype"] == "auto"


@pytest.mark.parametrize("case", fb.CASES)
def test_fit_knows_every_case_model_and_prices_the_runners_graphs_with_their_plan(case, tmp_path):
    """Each case's model reaches fit through its spec (the reference's dimensions, EAGLE's
    target's: model type reference; a transformers case's config.json: its own type), every
    family has measured node counts (graph memory known), and the plan of the runner's graphs
    gives the ``--plan`` figure. EAGLE's sizes are the shared sizes with its uniform decode
    sizes at query length 4 (bench/baselines.py; on an H100 all already in the grid), given to
    fit explicitly, with its draft (``--speculative-config``): the draft's weights counted, its
    graphs priced as vLLM's EAGLE speculator captures them (49 prefill graphs, 64 of the decode
    grid); with the plan of the runner's graphs, whose speculative phases stand for the draft's,
    unknown without a calibration of it."""
    if case not in ("reference", "eagle"):
        pytest.importorskip("transformers")
    if case == "eagle":  # its plan is built from the speculative reference's config (torch)
        pytest.importorskip("torch")
    s = fb.settings_for(H100, case=case)
    if case == "eagle":
        from bench.baselines import vllm_capture_sizes

        assert s.num_speculative_tokens == 3 and list(s.capture_sizes) == vllm_capture_sizes(decode_query_len=4)
    got = fb.fit_side(case, tmp_path, 32, H100, s)
    assert got["model_type"] == ("reference" if case in ("reference", "eagle") else case)
    graph = got["default"]["items"]["graph memory"]
    assert "items" in got["plan"], got["plan"]
    planned = got["plan"]["items"]["graph memory"]
    if case == "eagle":
        from capture_plan.references.speculative import SpeculativeConfig

        assert fb.EAGLE_DRAFT_LAYERS == SpeculativeConfig.draft_layers  # the draft the runner runs
        spec = json.loads(fb.fit_flags(s, tmp_path)["speculative-config"])
        assert (spec["method"], spec["num_speculative_tokens"]) == ("eagle", 3)
        assert got["default"]["items"]["draft weights"]["bytes"] > 0
        # the draft's graphs priced from vLLM's EAGLE speculator; the plan's own draft phases
        # stand for them, and only a calibration of them is taken (no double count)
        assert graph["status"] == "estimated" and graph["bytes"] > 1024 * 128256 * 2  # its 1024 requests' logits
        assert planned["status"] == "unknown" and planned["bytes"] is None
        return
    assert graph["bytes"] and graph["status"] == "estimated"
    assert got["plan"]["settings"]["cudagraph-capture-sizes"] == ",".join(map(str, s.capture_sizes))
    # the planner's simulation of the same FULL graphs, in the same order, that fit's estimate
    # simulates (planner/fit/graph_pool.py): one figure
    assert planned["bytes"] == graph["bytes"]


def test_a_spec_without_a_config_is_the_reference_decode_step(tmp_path, cli):
    """`planner fit --model SPEC.toml`: the reference's dimensions, its family's node counts, its
    weights as references/decode.py allocates them (an untied head, no rotary cache, no bias)."""
    from capture_plan.planner.fit.model import load_model, weight_bytes

    spec = fb.case_spec("reference", tmp_path, 32)
    m = load_model(str(spec))
    assert (m.model_type, m.layers, m.hidden, m.max_positions, m.tie_embeddings) == ("reference", 32, 4096, 0, False)
    per_layer = 2 * 4096 + (32 + 16) * 128 * 4096 + 32 * 128 * 4096 + 3 * 14336 * 4096
    assert weight_bytes(m, 1) == 2 * (2 * 128256 * 4096 + 32 * per_layer + 4096)
    args = ("--device", "H100", "--engine", "vllm==0.34.0", "--max-model-len", "4096", "--json")
    code, out, err = cli("fit", "--model", str(spec), *args)
    assert code == 0, err
    assert json.loads(out)["model"] == "llama-3-8b"


def test_a_spec_fit_cannot_read_is_one_line_naming_the_flag(tmp_path, cli):
    """Fails before: the fix named --spec, a flag fit does not have."""
    code, out, err = cli("fit", "--model", str(tmp_path / "nope.toml"), "--device", "H100", "--engine", "vllm==0.34.0")
    assert code == 1 and err.count("\n") == 1
    assert "cannot read spec" in err and "check the path given to --model" in err


def test_the_comparison_follows_the_issues_targets():
    runner = {"weights_bytes": 1000 * MIB, "activation_peak_bytes": GIB, "graph_bytes": 200 * MIB, "kv_tokens": 100_000}
    fitted = {
        "items": {
            "weights": {"bytes": 1000 * MIB + 1},
            "activation peak": {"bytes": GIB + 32 * MIB},  # 3.1%, but within 32 MiB
            "graph memory": {"bytes": None},  # unknown: never within
        },
        "kv_blocks": 6253,
        "block_tokens": 16,  # 100,048 tokens: +0.048%
    }
    got = fb.compare(runner, fitted)
    assert not got["weights"]["ok"] and got["weights"]["error_bytes"] == 1
    assert got["activation peak"]["ok"] and got["activation peak"]["error"] == pytest.approx(1 / 32)
    assert not got["graph memory"]["ok"] and got["graph memory"]["fit"] is None
    assert got["kv tokens"]["ok"] and got["kv tokens"]["fit"] == 100_048
    fitted["items"]["graph memory"]["bytes"] = 221 * MIB  # +10.5%
    fitted["kv_blocks"] = 6220  # -0.48%
    fitted["items"]["activation peak"]["bytes"] = 2 * GIB  # +100%
    got = fb.compare(runner, fitted)
    assert not got["graph memory"]["ok"] and got["kv tokens"]["ok"] and not got["activation peak"]["ok"]
    fitted["items"]["graph memory"]["bytes"] = 219 * MIB  # +9.5%
    assert fb.compare(runner, fitted)["graph memory"]["ok"]


def test_the_runners_weights_are_compared_with_the_targets_and_the_drafts_together():
    """The EAGLE runner's weights hold its draft's; fit counts the draft's as an item of its own
    (``draft weights``), which the comparison adds to the target's."""
    runner = {"weights_bytes": 1300 * MIB, "activation_peak_bytes": GIB, "graph_bytes": 0, "kv_tokens": 1}
    items = {"weights": {"bytes": 1000 * MIB}, "draft weights": {"bytes": 300 * MIB}}
    got = fb.compare(runner, {"items": items, "kv_blocks": 1, "block_tokens": 1})
    assert got["weights"]["fit"] == 1300 * MIB and got["weights"]["ok"]


def test_vllms_kv_blocks_span_a_group_of_layers():
    """kv_cache_planning: one type, all layers; 3 + 3 (Gemma2's 6), 3; 12 + 13, 13; 4 + 24, 4."""
    assert fb.page_group(8, 0) == 8 and fb.page_group(0, 6) == 6
    assert fb.page_group(3, 3) == 3 and fb.page_group(13, 12) == 13 and fb.page_group(4, 24) == 4


class Memory:
    """The fake device's memory as the worker reads it: a script of what each step allocates
    (torch's current and peak), caches and keeps outside torch."""

    def __init__(self, monkeypatch, total: int, used: int):
        import torch

        self.total, self.outside, self.allocated, self.peak, self.cached = total, used, 0, 0, 0
        cuda = torch.cuda
        monkeypatch.setattr(cuda, "mem_get_info", lambda d=None: (self.free(), total))
        monkeypatch.setattr(cuda, "memory_stats", self.stats)
        monkeypatch.setattr(cuda, "memory_reserved", lambda d=None: self.allocated + self.cached)
        monkeypatch.setattr(cuda, "empty_cache", self.empty)
        monkeypatch.setattr(cuda, "reset_peak_memory_stats", self.reset)
        monkeypatch.setattr(cuda, "get_device_name", lambda d=None: H100, raising=False)

    def free(self) -> int:
        return self.total - self.outside - self.allocated - self.cached

    def stats(self, d=None) -> dict:
        reserved = self.allocated + self.cached
        return {
            "allocated_bytes.all.current": self.allocated,
            "allocated_bytes.all.peak": self.peak,
            "reserved_bytes.all.current": reserved,
            "reserved_bytes.all.peak": reserved,
        }

    def empty(self) -> None:
        self.cached = 0

    def reset(self, d=None) -> None:
        self.peak = self.allocated

    def transient(self, nbytes: int) -> None:
        self.peak = max(self.peak, self.allocated + nbytes)
        self.cached = max(self.cached, nbytes)


@pytest.mark.parametrize(
    "case, release",
    [
        ("reference", "vllm==0.34.0"),
        ("llama", "vllm==0.34.0"),
        ("eagle", "vllm==0.34.0"),
        ("reference", "vllm==0.33.0"),
    ],
)
def test_the_runners_start_up_on_a_case_model(case, release, monkeypatch, tmp_path):
    """The 0.34.0 runner on a (tiny) case model, CUDA faked: its dummy runs (profile_run's and,
    with the extensible KV cache, the sizing warm-up's) go through the model's profiling
    forward at max_num_batched_tokens, every decode size is captured as a FULL graph of the
    model's decode step, the weights are the model's tensors, its decode cache is counted as
    KV (committed blocks after capture; before it, 0.33.0-shaped, given back to the budget the
    graph estimate is taken from), and fit's rule fed the runner's measured items gives the
    runner's blocks; the row is JSON and has its SUMMARY. EAGLE: the target's decode graphs at
    query length 4 (its verify phase), the speculator's draft prefill graphs and draft decode
    grid of vLLM's EAGLE head (tests/engines/case_model.py route_vllm_eagle), the dummy run's
    propose its prefill over all the run's tokens then its decode steps, the head's weights
    (fc; the target's embedding and lm_head) and cache layer counted with the target's."""
    pytest.importorskip("torch")
    from fake_cuda import install

    layers = 2
    if case in ("reference", "eagle"):
        from capture_plan.references.decode import ReferenceConfig, ReferenceModel
        from capture_plan.references.speculative import SpeculativeConfig, SpeculativeModel
        from capture_plan.schemas.spec import Model

        model = Model(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=100)
        if case == "eagle":
            target = SpeculativeModel(
                SpeculativeConfig(model=model, max_bs=8, max_seqlen=16), backend="torch", device="cpu"
            )
            models, layers = [target.target, target.draft], 3
        else:
            target = ReferenceModel(
                ReferenceConfig(model=model, max_bs=8, max_seqlen=16), backend="torch", device="cpu"
            )
            models = [target]
        weights = sum(t.nbytes for t in [models[0].embed] + [t for m in models for t in (m.lm_head, m.final_norm)])
        weights += sum(t.nbytes for m in models for layer in m.layers for k, t in layer.items() if "cache" not in k)
        if case == "eagle":  # vLLM's EAGLE head: + fc; no lm_head, final norm, first input norm of its own
            weights += 64 * 128 * 2 - 100 * 64 * 2 - 64 * 2 - 64 * 2
            from capture_plan.tests.engines.case_model import as_vllm_eagle

            as_vllm_eagle(target)  # start_up makes it so too (once)
            draft_layers, proposed = [], []
            layer_of = target.draft._layer
            target.draft._layer = lambda layer, h, bs, tpr, *a, **kw: (
                draft_layers.append((bs, tpr)),
                layer_of(layer, h, bs, tpr, *a, **kw),
            )[1]
            from capture_plan.tests.engines import engine_layers as layers_code

            eagle = layers_code.eagle_forward
            monkeypatch.setattr(
                layers_code, "eagle_forward", lambda ref, h: (proposed.append(h.shape[0]), eagle(ref, h))[1]
            )
        committed = sum(layer[k].nbytes for m in models for layer in m.layers for k in ("k_cache", "v_cache"))
        per_token = 2 * 2 * 16 * 2  # K and V, 2 KV heads of 16, bf16
    else:
        transformers = pytest.importorskip("transformers")
        from capture_plan.adapters.hf import HFTarget

        cfg = transformers.LlamaConfig(
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_hidden_layers=2,
            vocab_size=100,
        )
        hf = transformers.AutoModelForCausalLM.from_config(cfg).eval()
        target = HFTarget(hf, max_bs=8, max_seqlen=16, sdpa_backends=None)
        weights = sum(p.nbytes for p in hf.parameters())
        weights += sum(b.nbytes for n, b in hf.named_buffers() if "rotary_emb." not in n)
        weights += cfg.max_position_embeddings * 16 * 4  # vLLM's cos/sin cache, in the model's float32
        committed = sum(layer.keys.nbytes + layer.values.nbytes for layer in target.cache.layers)
        per_token = 2 * 2 * 16 * 4  # K and V, 2 KV heads of 16, float32
    # CUDA faked once the model is built (transformers' lazy imports read torch.cuda's types)
    install(monkeypatch)
    mem = Memory(monkeypatch, total=80 * GIB, used=GIB)
    util = 1.0 if release == "vllm==0.34.0" else 0.92
    k = 3 if case == "eagle" else 0
    sizes = (1, 2, 4, 8, 16, 32) if k else (1, 2, 4, 8)
    s = fb.Settings(
        util, 64, 8, max_num_batched_tokens=32, block_size=16, capture_sizes=sizes, num_speculative_tokens=k
    )
    module = fb.runner_034(tmp_path)
    snapshot = module.MemorySnapshot().measure()
    mem.outside += committed + weights  # the model built after the snapshot
    forwards, runs = [], []
    run = target.run
    # the dummy runs' forward: vLLM's layers over the transformers model's or the reference's
    # weights (tests/engines/engine_layers.py)
    from capture_plan.tests.engines import engine_layers

    name = "profile_forward" if case == "llama" else "reference_forward"
    real = getattr(engine_layers, name)

    def forward(*args):
        forwards.append(args[1].shape[0])  # (the model, the ids, ...)
        mem.transient(300 * MIB)
        return real(*args)

    monkeypatch.setattr(engine_layers, name, forward)
    monkeypatch.setattr(target, "run", lambda phase, bs, ws: (runs.append((phase, bs)), run(phase, bs, ws))[1])
    extensible = release == "vllm==0.34.0"
    made = {}  # the release's persistent buffers, as the runner holds them when it is released
    release_runner = module.GPUModelRunner.release

    def release_and_record(runner):
        made.update(
            counts=tuple(runner.sampler.penalties_state.output_bin_counts.shape),
            bitmask=tuple(runner.structured_outputs_worker.grammar_bitmask.shape),
            tables=[tuple(t.shape) for t in runner.block_tables.block_tables],
            sampler=type(runner.sampler),
        )
        release_runner(runner)

    monkeypatch.setattr(module.GPUModelRunner, "release", release_and_record)
    import torch

    events, stream, profile = [], torch.cuda.Stream, module.GPUModelRunner.profile_run
    monkeypatch.setattr(torch.cuda, "Stream", lambda *a, **kw: (events.append("stream"), stream(*a, **kw))[1])
    monkeypatch.setattr(module.GPUModelRunner, "profile_run", lambda r: (events.append("profile"), profile(r))[1])
    record = fb.start_up(module, target, s, snapshot, extensible=extensible)
    # the process's first torch stream made by the runner's __init__ (the release's
    # output_copy_stream), after the init snapshot and before the profile: not in the capture
    assert events[0] == "stream" and "profile" in events
    # max_num_seqs 8 x the vocabulary 100; 1 + k rows a request; one KV group, 64 / 16 = 4 blocks a
    # row to a multiple of 8; 0.33.0-shaped, 0.33.0's sampler (fails before: none of them made)
    assert made["counts"] == (8, 100) and made["bitmask"] == (8 * (1 + k), 4) and made["tables"] == [(8, 8)]
    assert made["sampler"] is (module.Sampler if extensible else module.Sampler.__base__)
    assert forwards == [32, 32][: 1 + extensible]  # profile_run's dummy run, then the sizing warm-up's
    assert record["weights_bytes"] == weights and record["measured"]["committed_bytes"] == committed
    assert record["measured"]["kv_bytes_per_token_layer"] == per_token
    assert record["activation_peak_bytes"] == 300 * MIB
    assert record["block_bytes"] == layers * 16 * per_token  # every layer's page: one block
    # capture_model's drop is recorded with torch's share of it (the rest the driver's)
    m = record["measured"]
    assert m["capture_drop_bytes"] == record["graph_bytes"] and isinstance(m["capture_reserved_growth_bytes"], int)
    captured = {p: sorted({n for q, n in runs if q == p}) for p, _ in runs}
    if k:  # requests of the decode graphs at query length 4: the shared sizes' (tokens / 4), to 32 tokens
        grid = module.decode_cudagraph_capture_grid(8)
        assert captured == {"target_verify": [1, 2, 4, 8]}  # the draft is the EAGLE head's, not a phase
        assert record["measured"]["graphs"] == 4 + 4 + len(grid) and record["measured"]["draft_graphs"] == [
            4,
            len(grid),
        ]
        # the dummy runs' propose (the profile's, then 0.34.0's sizing warm-up's): vLLM's eager
        # layers over all 32 tokens of 8 requests, then its 2 decode steps of one token a request;
        # the graphs: the prefill manager's at 4 tokens a request, the decode grid's at one
        assert proposed[:3] == [32, 8, 8], proposed
        assert set(draft_layers) == {*((n, 4) for n in (1, 2, 4, 8)), *((n, 1) for n in grid)}
    else:
        assert captured == {"decode": [1, 2, 4, 8]} and record["measured"]["graphs"] == 4
    check = fb.rule_check(record, release)
    assert check["blocks"] == record["blocks"] > 0 and check["error"] == 0
    if extensible:  # the decode cache counts as the cache's: the free side gets it back
        assert record["measured"]["graph_estimate_samples_bytes"] == []  # 0.34.0 samples none
        margin = max(GIB, int(300 * MIB * 0.75))
        free = 80 * GIB - GIB - committed - weights
        assert record["blocks"] == (free + committed - margin - 300 * MIB) // record["block_bytes"]
    else:  # the budget less what the profile consumed but the decode cache, its peak, the estimate
        assert record["graph_estimate_bytes"] == 3 * MIB  # 4 graphs: 3 at vLLM's 1 MiB floor (no drop here)
        # the two FULL captures the estimate sampled, recorded (the fake device drops nothing)
        assert record["measured"]["graph_estimate_samples_bytes"] == [0, 0]
        budget = math.ceil(80 * GIB * 0.92) - weights - 300 * MIB - 3 * MIB
        assert record["blocks"] == budget // record["block_bytes"]
    fitted = {"default": {"items": {}, "kv_blocks": record["blocks"], "block_tokens": 16}, "plan": {"skipped": "x"}}
    row = fb.case_row(record, fitted, release)
    json.dumps(row)
    line = fb.summary_line(case, row, release)
    assert line.startswith(f"SUMMARY {case} {release} weights unknown FAIL; activation unknown FAIL; graph unknown")
    assert "kv tokens +0.0% ok" in line and "rule on measured items +0.00%" in line


def test_a_skipped_or_failed_case_has_its_summary_line():
    skipped = {"skipped": "eagle does not fit this device: ..."}
    assert fb.summary_line("eagle", skipped) == "SUMMARY eagle vllm==0.34.0 skipped: " + skipped["skipped"]
    assert fb.summary_line("llama", {"error": "Tb"}, "vllm==0.33.0") == "SUMMARY llama vllm==0.33.0 FAILED: see error"


def test_the_profiling_forward_attends_to_nothing():
    """A case model's ``profile_hidden`` (the profiling run's forward): every row depends on its
    own token alone (attention skipped), whatever its neighbours and position (the rotary
    embedding turns q and k only, which nothing reads)."""
    pytest.importorskip("torch")
    import torch

    from capture_plan.references.decode import ReferenceConfig, ReferenceModel
    from capture_plan.schemas.spec import Model

    model = Model(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=100)
    ref = ReferenceModel(ReferenceConfig(model=model, max_bs=2, max_seqlen=8), backend="torch", device="cpu")
    targets = [ref]
    transformers = pytest.importorskip("transformers")
    from capture_plan.adapters.hf import HFTarget

    for name in ("llama", "gemma2", "qwen2_moe"):
        cfg = bench_module("harness").hf_config(name, num_hidden_layers=2, hidden_size=64, intermediate_size=128)
        if name == "qwen2_moe":
            cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size = 32, 64
        cfg.head_dim = 16
        cfg._attn_implementation = bench_module("harness").HF_ARCHS[name][2]
        torch.manual_seed(0)
        hf = transformers.AutoModelForCausalLM.from_config(cfg).eval()
        targets.append(HFTarget(hf, max_bs=2, max_seqlen=8, sdpa_backends=None))
    for t in targets:
        a = t.profile_hidden(torch.tensor([5, 7, 9, 11]))
        b = t.profile_hidden(torch.tensor([11, 3, 9, 5]))
        assert a.shape[0] == 4
        # equal up to the kernels' reduction order over a different batch
        same = {"rtol": 1e-5, "atol": 1e-5}
        assert torch.allclose(a[2], b[2], **same) and torch.allclose(a[0], b[3], **same), type(t).__name__
        assert not torch.allclose(a[0], a[1], **same)


def test_the_command_writes_one_json_with_every_case_and_a_summary_line_each(monkeypatch, tmp_path, capsys):
    """``python -m bench.fit_bench`` with its case processes stubbed: the runner's record and
    settings come back from the child, fit runs for the device the child named with those
    settings, the JSON has the header, the device's fields (from the child: the parent holds
    no CUDA context), the targets, what differs from vLLM, and per case the runner, fit (with
    and without the plan) and the comparisons; a case whose model does not fit the device is
    listed with its reason."""
    pytest.importorskip("transformers")
    import subprocess

    s = fb.settings_for(H100)
    runner = {
        "weights_bytes": 970 * MIB,
        "activation_peak_bytes": 600 * MIB,
        "graph_bytes": 90 * MIB,
        "transient_peak_bytes": 700 * MIB,
        "torch_reserve_growth_bytes": 0,
        "blocks": 150_000,
        "block_bytes": 8 * 16 * 2048,
        "kv_tokens": 150_000 * 16,
        "measured": {
            "requested_bytes": 80 * GIB,
            "init_free_bytes": 79 * GIB,
            "free_after_capture_bytes": 70 * GIB,
            "committed_bytes": 4 * GIB,
            "graphs": 51,
        },
    }
    device = {"device": H100, "driver": "580", "torch": "2.11.0", "cuda": "13.0"}
    child = {"device": device, "settings": fb.asdict(s), "runner": runner}
    calls = []

    skipped = {"skipped": "gemma2 does not fit this device: its KV cache ..."}

    def run_module(name, args, **kw):
        calls.append([name, *args])
        got = child if args[1] == "llama" else skipped
        return subprocess.CompletedProcess(args, 0, stdout="log\nRESULT " + json.dumps(got) + "\n", stderr="")

    monkeypatch.setattr(fb, "run_module", run_module)
    monkeypatch.setattr("sys.argv", ["fit_bench", "--cases", "llama,gemma2", "--out", str(tmp_path), "--tag", "t"])
    assert fb.main() is None
    assert calls == [
        ["fit_bench", "--child", case, "--layers", "32", "--releases", "vllm==0.34.0"] for case in ("llama", "gemma2")
    ]
    (path,) = tmp_path.glob("fit-bench-*-t.json")
    res = json.loads(path.read_text())
    assert {"date", "git_commit", "git_dirty", *device} <= set(res) and res["device"] == H100
    assert res["releases"] == {"vllm==0.34.0": fb.RELEASES["vllm==0.34.0"]}
    assert res["differs"] == fb.DIFFERS and set(res["targets"]) == set(fb.TARGETS)
    row = res["cases"]["llama"]["vllm==0.34.0"]
    assert row["settings"]["capture_sizes"] == list(s.capture_sizes) and row["runner"] == runner
    assert set(row["compare"]) == set(row["compare_plan"]) == set(fb.TARGETS)
    assert row["compare"]["weights"]["runner"] == 970 * MIB and row["fit"]["default"]["items"]["weights"]["bytes"]
    assert res["cases"]["gemma2"] == {"vllm==0.34.0": skipped}
    out = capsys.readouterr().out.splitlines()
    assert out[-2].startswith("SUMMARY llama vllm==0.34.0 weights ")
    assert out[-1] == "SUMMARY gemma2 vllm==0.34.0 skipped: " + skipped["skipped"]
    # docs/measurements.md's table reads the file: the runner's figure against fit's, per case
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "docs_generate_fit", Path(__file__).resolve().parent.parent / "docs" / "generate.py"
    )
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    monkeypatch.setattr(gen, "RESULTS", tmp_path)
    table = gen.fit_bench()
    (llama,) = [line for line in table if line.startswith("| llama ")]
    assert llama.startswith("| llama | vllm 0.34.0 | 970 / ")
    assert "| gemma2 | vllm 0.34.0 | skipped |" in "\n".join(table)
    assert table[-1].startswith(f"Source: `bench/results/{path.name}` (NVIDIA H100 80GB HBM3, torch 2.11.0, ")
    monkeypatch.setattr(gen, "RESULTS", tmp_path / "none")
    assert gen.fit_bench() == ["Not measured yet: `python -m bench.fit_bench` writes the JSON this table reads."]


MEASURED = Path(__file__).resolve().parent.parent / "bench/results/fit-bench-2026-12-06-h100.json"


def test_a_refit_keeps_the_runners_records_and_recomputes_fits_side(monkeypatch, tmp_path):
    """`--refit`: fit's figures of a measured run again at this commit, on the CPU. Fed the
    figures fit gave at the run, every comparison and rule check comes out as the run wrote
    it (the plumbing loses nothing); the runner's records, settings and device are the run's
    as measured, and the result names the run it refits."""
    source = json.loads(MEASURED.read_text())
    rows = {(c, r): row for c, runs in source["cases"].items() for r, row in runs.items()}
    seen = []

    def fit_side(case, folder, layers, device_name, s, release, graphs):
        row = rows[(case, release)]
        assert (device_name, graphs, layers) == (
            row["device"]["device"],
            row["runner"]["measured"]["graphs"],
            source["layers"],
        )
        assert s == fb.Settings(**{**row["settings"], "capture_sizes": tuple(row["settings"]["capture_sizes"])})
        seen.append(case)
        return row["fit"]

    monkeypatch.setattr(fb, "fit_side", fit_side)
    res = fb.refit(source, MEASURED.name, tmp_path)
    assert sorted(seen) == sorted(source["cases"]) and res["device"] == source["device"]
    assert res["refit_of"]["file"] == MEASURED.name and res["refit_of"]["git_commit"] == source["git_commit"]
    for (case, release), row in rows.items():
        # what fit leaves out is fit's side: a refit writes today's words for it, and its
        # rule check is this commit's rule fed the run's measured items
        want = {**row, "fit_lacks": fb.FIT_LACKS[case]} if "fit_lacks" in row else row
        want = {**want, "rule_check": fb.rule_check(row["runner"], release)}
        assert res["cases"][case][release] == want, case


def test_a_refit_runs_the_planner_as_it_is_now(tmp_path):
    """The real fit over one measured case (qwen2_moe): its runner record untouched, fit's
    figures fresh, each item compared against the same runner figure."""
    pytest.importorskip("transformers")
    source = json.loads(MEASURED.read_text())
    source["cases"] = {"qwen2_moe": source["cases"]["qwen2_moe"]}
    res = fb.refit(source, MEASURED.name, tmp_path)
    old, new = source["cases"]["qwen2_moe"]["vllm==0.34.0"], res["cases"]["qwen2_moe"]["vllm==0.34.0"]
    assert new["runner"] == old["runner"] and set(new["compare"]) == set(old["compare"])
    for item, c in new["compare"].items():
        assert c["runner"] == old["compare"][item]["runner"] and c["fit"] is not None, item


# -- SGLang 0.5.23 (bench/fit_bench_sglang.py) ---------------------------------------------------

sgl = bench_module("fit_bench_sglang")


def test_the_sglang_runners_start_up_on_a_case_model(monkeypatch, tmp_path):
    """The SGLang 0.5.23-shaped start-up on a tiny reference model, CUDA faked: the free memory
    read before the model is built, the pool sized from the free memory after it (the model's
    own decode cache counted as the pool's) less the static slack, as SGLang's
    _profile_available_bytes and calculate_pool_sizes give it by hand; the release's decode
    runner captures every configured size, largest first, two warm-ups and a recording each,
    between two readings of the free memory (the shared logits buffer made inside them); the
    prefill chunk's peak measured; fit's rule fed the runner's items gives its tokens."""
    pytest.importorskip("torch")
    import sys

    from capture_plan.references.decode import ReferenceConfig, ReferenceModel
    from capture_plan.schemas.spec import Model
    from capture_plan.tests.engines import adoption, sglang_memory as sm, sglang_runner
    from fake_cuda import install

    model = Model(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=100)
    target = ReferenceModel(ReferenceConfig(model=model, max_bs=8, max_seqlen=16), backend="torch", device="cpu")
    weights = sum(t.nbytes for t in (target.embed, target.lm_head, target.final_norm))
    weights += sum(t.nbytes for layer in target.layers for k, t in layer.items() if "cache" not in k)
    committed = sum(layer[k].nbytes for layer in target.layers for k in ("k_cache", "v_cache"))
    install(monkeypatch)
    mem = Memory(monkeypatch, total=64 * MIB, used=8 * MIB)
    ms = sm.handle_gpu_memory_settings(
        81559,
        context_len=64,
        chunked_prefill_size=32,
        decode_bs=[1, 2, 4, 8],
        mem_fraction_static=0.5,
        prefill_backend=sm.DISABLED,
    )
    module = adoption.before_module(Path(sglang_runner.__file__), tmp_path, "sglang_fit_bench_test")
    monkeypatch.delitem(sys.modules, "sglang_fit_bench_test")
    import torch

    events, reading, stream = [], sm.get_available_gpu_memory, torch.cuda.Stream
    monkeypatch.setattr(sm, "get_available_gpu_memory", lambda *a: (events.append("reading"), reading(*a))[1])
    monkeypatch.setattr(torch.cuda, "Stream", lambda *a, **kw: (events.append("stream"), stream(*a, **kw))[1])
    startup = sm.StartUp(module, ms)
    assert startup.pre_model_load_memory == 56 / 1024  # GiB, as get_available_gpu_memory returns it
    # ModelRunner.__init__'s forward_stream, the process's first torch stream, right after the reading
    assert events == ["reading", "stream"] and startup.forward_stream is not None
    mem.outside += weights + committed  # the model built after the reading
    runs, peaks = [], []
    real_run = target.run
    # the prefill chunk's forward: vLLM's layers over the reference's weights (engine_layers)
    from capture_plan.tests.engines import engine_layers

    real_forward = engine_layers.reference_forward

    def reference_forward(ref, ids):
        peaks.append(ids.shape[0])
        mem.transient(5 * MIB)
        return real_forward(ref, ids)

    monkeypatch.setattr(target, "run", lambda phase, bs, ws: (runs.append((phase, bs)), real_run(phase, bs, ws))[1])
    monkeypatch.setattr(engine_layers, "reference_forward", reference_forward)
    create = sgl_case_model().create_logits_buffer

    def create_logits_buffer(self, rows):  # the fake device sees the buffer the runner makes
        buf = create(self, rows)
        mem.outside += buf.nbytes
        return buf

    monkeypatch.setattr(sgl_case_model(), "create_logits_buffer", create_logits_buffer)
    record = sgl.start_up(startup, target)
    m = record["measured"]
    cell = 2 * (2 * 2 * 16 * 2)  # 2 layers of K and V, 2 KV heads of 16, bf16
    assert m["kv_cell_bytes"] == cell and m["committed_bytes"] == committed and record["weights_bytes"] == weights
    # _profile_available_bytes: (free after loading + the model's cache) - 56 MiB x (1 - 0.5), in GiB
    rest = int(((56 * MIB - weights) / GIB - 56 / 1024 * 0.5) * GIB)
    assert m["rest_bytes"] == rest and record["kv_tokens"] == rest // cell == record["blocks"]
    assert record["kv_bytes"] == record["kv_tokens"] * cell and m["pool_allocated_bytes"] == (rest // cell + 1) * cell
    assert record["settings"]["max_running_requests"] == min(4096, rest // cell // 2)
    assert [bs for _, bs in runs[:3]] == [8, 8, 8] and sorted({bs for _, bs in runs}) == [1, 2, 4, 8]
    assert len(runs) == 4 * 3 and {p for p, _ in runs} == {"decode"} and m["graphs"] == 4
    assert record["graph_bytes"] == 8 * 100 * 4  # the shared float32 logits buffer: 8 rows of the vocabulary
    assert peaks == [32] and record["activation_peak_bytes"] == 5 * MIB
    assert record["graph_estimate_bytes"] == 8 * 2 * MIB  # reserve_for_graph_mb: max_bs x 2, no prefill graphs
    check = sgl.rule_check(record)
    assert check["blocks"] == record["blocks"] and check["error"] == 0
    row = sgl.case_row(record, {"refused": "x"}, None)
    json.dumps(row)
    assert row["compare"] is None and row["rule_check"]["blocks"] == record["blocks"]
    line = fb.summary_line("reference", row, sgl.RELEASE)
    assert line == f"SUMMARY reference sglang==0.5.23 fit refused (x); kv tokens {record['kv_tokens']:,} runner"


def sgl_case_model():
    from capture_plan.tests.engines.case_model import SGLangCaseModel

    return SGLangCaseModel


def test_a_refit_of_an_sglang_run_recomputes_fits_side(tmp_path):
    """`--refit` over an SGLang result: the runner's records kept, fit's figures for the
    runner's settings (the same memory settings resolved on both sides, prefill graphs off),
    the rule check on the runner's items worked by hand, a sliding-window model (Gemma2) priced
    as SGLang 0.5.23 sizes it, with one pool over every layer (fit refused it before), a skipped
    case kept; ``differs_sglang`` listed."""
    pytest.importorskip("transformers")
    _, s = sgl.resolve(81559, fb.MAX_MODEL_LEN)
    pre, available, weights, cell = 79 * GIB, 78 * GIB, 1_017_188_608, 8 * 4096  # llama: 8 layers, 4096 a layer
    tokens = int(((available) / GIB - (pre / GIB) * (1 - 0.835)) * GIB) // cell
    runner = {
        "weights_bytes": weights,
        "activation_peak_bytes": 400 * MIB,
        "graph_bytes": 150 * MIB,
        "kv_tokens": tokens,
        "blocks": tokens,
        "block_size": 1,
        "block_bytes": cell,
        "settings": {"mem_fraction_static": 0.835},
        "measured": {"pre_model_load_bytes": pre, "available_bytes": available, "kv_cell_bytes": cell, "graphs": 36},
    }
    device = {"device": H100, "driver": "580", "torch": "2.11.0", "cuda": "13.0"}
    row = {"device": device, "settings": fb.asdict(s), "runner": runner}
    source = {
        "device": H100,
        "git_commit": "abc",
        "date": "2026-12-06",
        "layers": 32,
        "releases": {sgl.RELEASE: sgl.DESCRIPTION},
        "cases": {
            "llama": {sgl.RELEASE: row},
            "gemma2": {sgl.RELEASE: row},
            "eagle": {sgl.RELEASE: {"skipped": "eagle: " + sgl.SKIP["eagle"]}},
        },
    }
    from capture_plan.planner.fit.model import kv_bytes_per_token, load_model

    res = fb.refit(source, "fit-bench-x.json", tmp_path)
    assert res["differs_sglang"] == sgl.DIFFERS and res["cases"]["eagle"] == source["cases"]["eagle"]
    got = res["cases"]["llama"][sgl.RELEASE]
    assert got["runner"] == runner and got["settings"] == row["settings"]
    assert got["fit"]["default"]["settings"]["disable-prefill-cuda-graph"] is True
    assert all(v["ok"] for v in got["settings_check"].values()), got["settings_check"]
    assert got["rule_check"]["blocks"] == tokens and got["rule_check"]["error"] == 0
    assert got["compare"]["kv tokens"]["fit"] == got["fit"]["default"]["kv_tokens"]
    assert got["compare_plan"] is None and "skipped" in got["fit"]["plan"]
    assert fb.summary_line("llama", got, sgl.RELEASE).endswith("rule on measured items +0.00%; settings ok")
    gemma2 = res["cases"]["gemma2"][sgl.RELEASE]
    fitted = gemma2["fit"]["default"]
    model = load_model(str(fb.case_spec("gemma2", tmp_path, 32)))
    cell = kv_bytes_per_token(model, 1, model.dtype_bytes) * model.layers  # every layer, the sliding ones too
    assert model.sliding_layers > 0 and fitted["kv_tokens"] == fitted["kv_bytes"] // cell > 0
    assert gemma2["compare"]["kv tokens"]["fit"] == fitted["kv_tokens"]
    assert fb.summary_line("gemma2", gemma2, sgl.RELEASE).startswith("SUMMARY gemma2 sglang==0.5.23 weights ")


def test_the_command_runs_sglang_cases_and_the_docs_table_reads_them(monkeypatch, tmp_path, capsys):
    """``--releases sglang==0.5.23``: each case's child runs that release, the rows have the
    comparisons and the settings check (Gemma2's too: one pool over every layer), a model fit
    refuses (here qwen2, by a stand-in refusal) keeps the runner's figures, and
    docs/measurements.md's table reads them (the refusal as such)."""
    pytest.importorskip("transformers")
    import importlib.util
    import subprocess

    _, s = sgl.resolve(81559, fb.MAX_MODEL_LEN)
    runner = {
        "weights_bytes": 1_017_188_608,
        "activation_peak_bytes": 400 * MIB,
        "graph_bytes": 150 * MIB,
        "kv_tokens": 2_000_000,
        "blocks": 2_000_000,
        "block_size": 1,
        "block_bytes": 32768,
        "settings": {"mem_fraction_static": 0.835},
        "graph_pool_bytes": 60 * MIB,
        "measured": {
            "pre_model_load_bytes": 79 * GIB,
            "available_bytes": 78 * GIB,
            "kv_cell_bytes": 32768,
            "kv_bytes_per_token_layer": 4096,
            "layers": {"full": 8, "sliding": 0},
            "committed_bytes": 1 * GIB,
            "logits_buffer_bytes": 31 * MIB,
            "capture_reserved_growth_bytes": 123 * MIB,  # the pool, the buffer and 32 MiB of workspaces
        },
    }
    device = {"device": H100, "driver": "580", "torch": "2.11.0", "cuda": "13.0"}
    got = {"device": device, "settings": fb.asdict(s), "runner": runner}
    calls = []

    def run_module(name, args, **kw):
        calls.append(args)
        return subprocess.CompletedProcess(args, 0, stdout="RESULT " + json.dumps(got) + "\n", stderr="")

    real_fit_side = sgl.fit_side

    def fit_side(case, *args):
        return {"refused": "a stand-in refusal"} if case == "qwen2" else real_fit_side(case, *args)

    monkeypatch.setattr(fb, "run_module", run_module)
    monkeypatch.setattr(sgl, "fit_side", fit_side)
    cases = "llama,gemma2,qwen2"
    argv = ["fit_bench", "--cases", cases, "--releases", sgl.RELEASE, "--out", str(tmp_path), "--tag", "s"]
    monkeypatch.setattr("sys.argv", argv)
    assert fb.main() is None
    assert [a[-1] for a in calls] == [sgl.RELEASE] * 3
    (path,) = tmp_path.glob("fit-bench-*-s.json")
    res = json.loads(path.read_text())
    assert res["releases"] == {sgl.RELEASE: sgl.DESCRIPTION} and res["differs_sglang"] == sgl.DIFFERS
    llama, gemma2, qwen2 = (res["cases"][c][sgl.RELEASE] for c in cases.split(","))
    for row in (llama, gemma2):
        assert set(row["compare"]) == set(fb.TARGETS) and row["settings_check"]["mem-fraction-static"]["ok"]
    assert qwen2["compare"] is None and qwen2["runner"] == runner
    out = capsys.readouterr().out.splitlines()
    assert out[-3].startswith("SUMMARY llama sglang==0.5.23 weights ")
    assert out[-2].startswith("SUMMARY gemma2 sglang==0.5.23 weights ")
    assert out[-1] == "SUMMARY qwen2 sglang==0.5.23 fit refused (a stand-in refusal); kv tokens 2,000,000 runner"
    spec = importlib.util.spec_from_file_location(
        "docs_generate_fit_sglang", Path(__file__).resolve().parent.parent / "docs" / "generate.py"
    )
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    monkeypatch.setattr(gen, "RESULTS", tmp_path)
    table = "\n".join(gen.fit_bench())
    assert "| llama | sglang 0.5.23 | 970 / " in table
    assert "| gemma2 | sglang 0.5.23 | 970 / " in table
    assert "| qwen2 | sglang 0.5.23 | fit refused |  |  |  | 2,000,000 / refused |" in table
    # docs/fit.md's SGLang table: the drop = pool + logits buffer + the rest, the rest split into
    # torch's reserve growth beyond the pool and the buffer and the driver's
    sglang_table = "\n".join(gen.fit_sglang_bench())
    assert "| llama | 970 / " in sglang_table and "| 150 = 60 + 31 + 59 (torch 32 + driver 27) |" in sglang_table


@pytest.mark.parametrize("case", ["llama", "gemma2", "qwen2", "mixtral", "qwen2_moe"])
@pytest.mark.parametrize(("release", "element"), [("sglang==0.5.23", "float32"), ("vllm==0.34.0", None)])
def test_fits_weights_are_the_case_models_with_the_engines_rope_cache(case, release, element, tmp_path):
    """What a runner counts as weights (the case model's parameters and buffers, its
    transformers rotary buffers replaced by the engine's cos/sin cache: SGLang's float32,
    vLLM's in the model's dtype; case_model.engine_weights as each start_up calls it) is fit's
    weights for the release to the byte, on each bench architecture made small: gemma2's four
    norms a layer and its normalizer, qwen2_moe's shared-expert gate, the rope cache."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import msgspec

    from bench.harness import hf_config
    from capture_plan.planner.fit.model import load_model, weight_bytes
    from capture_plan.planner.fit.rope import rotary_cache
    from capture_plan.tests.engines.case_model import engine_weights, measured_weights

    small = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2)
    small |= dict(num_hidden_layers=2, vocab_size=128, max_position_embeddings=96)
    small |= {"gemma2": dict(head_dim=16), "mixtral": dict(num_local_experts=4)}.get(case, {})
    if case == "qwen2_moe":
        small |= dict(num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=48)
    cfg = hf_config(case, **small, dtype="bfloat16")
    (tmp_path / "config.json").write_text(cfg.to_json_string())
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    target = type("Target", (), {"model": model})()
    runner, rope = engine_weights(target, element and getattr(torch, element))
    assert rope.dtype == getattr(torch, element or "bfloat16") and rope.shape == (96, 16)
    assert measured_weights(target) > measured_weights(target, rotary=False)  # inv_freq left out
    m = load_model(str(tmp_path / "config.json"))
    engine, version = release.split("==")
    rope = rotary_cache(m, engine, version)  # fit_rules.toml [rope.*]: float32 rows (SGLang), model dtype (vLLM)
    assert weight_bytes(msgspec.structs.replace(m, max_positions=0), 1) + rope.bytes == runner


def test_sglangs_case_model_soft_caps_gemma2s_logits_in_the_float32_buffer(monkeypatch):
    """SGLang 0.5.23 fuses Gemma2's final soft-capping into the float32 copy of the logits
    (logits_processor.py ``_copy_logits_to_buffer``: ``softcap_to_float32_logits``), so its
    decode graph holds the model-dtype logits and nothing more in the pool; the case model's
    decode step writes cap * tanh(logits / cap) into the rows of the shared buffer and
    returns a view of them (its float32 values, not those of a model-dtype soft-capping)."""
    torch = pytest.importorskip("torch")
    from types import SimpleNamespace

    cls = sgl_case_model()
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 16, bias=False).to(torch.bfloat16)
    model = cls.__new__(cls)
    model.head, model.softcap, model.vocab, model.device = head, 5.0, 16, "cpu"
    model.x = torch.zeros(4, dtype=torch.long)
    hidden = 4 * torch.randn(4, 8, dtype=torch.bfloat16)
    monkeypatch.setattr(model, "piece", lambda k, x: hidden[: x.shape[0]], raising=False)
    model.target = SimpleNamespace()
    buf = model.create_logits_buffer(4)
    out = model.forward("decode", 3, None)
    want = 5.0 * torch.tanh(head(hidden[:3]).float() / 5.0)
    assert out.data_ptr() == buf.data_ptr() and out.dtype == torch.float32
    assert torch.allclose(out, want, atol=1e-6) and buf[3].abs().sum() == 0
    assert not torch.equal(out, (5.0 * torch.tanh(head(hidden[:3]) / 5.0)).float())  # not soft-capped in bf16
    model.softcap = None
    assert torch.equal(model.forward("decode", 2, None), head(hidden[:2]).float())


@pytest.mark.parametrize("case", ["mixtral", "qwen2_moe", "llama"])
def test_the_vllm_runners_hold_vllms_fused_moe_workspace_as_its_manager_does(case, tmp_path):
    """vLLM's fused-MoE layer takes its workspace from the workspace manager, which keeps it and
    grows it to the largest forward (workspace.py ``_ensure_workspace_size``); transformers' MoE
    layers ask for none, so the runners' case model allocates it at each dummy run, as the
    engine's first MoE layer would: grown, never shrunk, kept. Its bytes are fit's
    (planner/fit/estimate.py ``moe_workspace``) for the case's config, read independently. A
    dense model holds none; SGLang's case model none either (its fused MoE allocates per call)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from bench.harness import hf_config
    from capture_plan.planner.fit.estimate import moe_workspace
    from capture_plan.planner.fit.model import load_model
    from capture_plan.tests.engines import case_model as cm

    text = hf_config(case, dtype="bfloat16").get_text_config(decoder=True)
    model = cm.CaseModel.__new__(cm.CaseModel)
    model.device, model.workspace, model.moe = "cpu", None, cm.moe_dims(text)
    fitted = load_model(str(fb.case_spec(case, tmp_path, 32)))
    if case == "llama":
        assert model.moe is None and moe_workspace(fitted, 1, 8192) == 0
        model.moe_workspace(8192)
        assert model.workspace is None
        return
    assert cm.fused_moe_workspace_bytes(8192, *model.moe) == moe_workspace(fitted, 1, 8192) > 0
    model.moe_workspace(4096)
    first = model.workspace
    assert first is not None and first.numel() == moe_workspace(fitted, 1, 4096)
    model.moe_workspace(16)
    assert model.workspace is first  # a smaller forward reuses it
    model.moe_workspace(8192)
    assert model.workspace.numel() == moe_workspace(fitted, 1, 8192) and model.workspace.dtype == torch.uint8
    assert sgl_case_model().persistent_moe_workspace is False and cm.CaseModel.persistent_moe_workspace is True


def test_the_runners_profiling_forward_is_vllms_layers_over_the_models_weights():
    """tests/engines/engine_layers.py (vLLM's eager decoder layers over a transformers model's
    weights, what the runners' dummy runs run for the transformers cases) computes what
    transformers' own layers compute with attention skipped (``HFTarget.profile_hidden``): the
    same hidden states, for each architecture the bench runs (Qwen2's q/k/v biases, Gemma2's
    four norms, scaled embedding and GeLU, Mixtral's routed experts, Qwen2-MoE's gated shared
    expert), its MoE caches cut from a held workspace (vLLM's) or allocated per call (SGLang's)."""
    pytest.importorskip("torch")
    import torch
    import torch.nn.functional as F

    transformers = pytest.importorskip("transformers")
    from capture_plan.adapters.hf import HFTarget
    from capture_plan.tests.engines import engine_layers
    from capture_plan.tests.engines.case_model import CaseModel, fused_moe_workspace_bytes, moe_dims

    harness = bench_module("harness")
    for name in ("llama", "qwen2", "gemma2", "mixtral", "qwen2_moe"):
        cfg = harness.hf_config(name, num_hidden_layers=2, hidden_size=64, intermediate_size=128)
        if name == "qwen2_moe":
            cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size = 32, 64
        cfg.head_dim = 16
        torch.manual_seed(0)
        hf = transformers.AutoModelForCausalLM.from_config(cfg).eval()
        target = HFTarget(hf, max_bs=2, max_seqlen=8, sdpa_backends=None)
        # float64 (after the target's float32 buffers): both norms compute in float32 (as vLLM's
        # kernels do), in orders that agree to ~1e-7; a wrong step is off by 1e-4 or more
        hf.to(torch.float64)
        # transformers' grouped GEMM takes no float64: its reference loop (host-routed) does
        hf.config._experts_implementation = "eager"
        for p in hf.parameters():  # transformers initialises norms to 1 (Gemma's to 0): make them count
            p.data.normal_(0.0, 0.5)
        ids = torch.tensor([5, 7, 9, 11, 3] * 120)  # more rows than a stand-in's chunk
        x = torch.randn(7, 64, dtype=torch.float64)
        attn = hf.model.layers[0].self_attn  # the merged projection (biases: Qwen2's), which nothing later reads
        with torch.no_grad():
            linears = (attn.q_proj, attn.k_proj, attn.v_proj)
            merged = torch.cat([F.linear(x, p.weight, p.bias) for p in linears], -1)
            assert torch.allclose(engine_layers._projections(x, linears), merged)
        case = CaseModel(target, len(ids))
        assert case.engine_layers is hf
        theirs = target.profile_hidden(ids)
        outs = [engine_layers.profile_forward(hf, ids)]  # caches allocated per call
        vllm = outs[0]
        dims = moe_dims(hf.config)
        if dims is not None:  # and cut from a held workspace of the size vLLM's manager asks for
            held = torch.full((fused_moe_workspace_bytes(len(ids), *dims[:3], 8),), 255, dtype=torch.uint8)
            vllm = engine_layers.profile_forward(hf, ids, engine_layers.Workspace(held))
            outs.append(vllm)
            assert (held != 255).any()
        outs.append(engine_layers.profile_forward(hf, ids, engine="sglang"))  # SGLang's norms, MoE in place
        for ours in outs:
            assert ours.shape == theirs.shape == (len(ids), 64)
            assert torch.allclose(ours, theirs, rtol=2e-6, atol=2e-6), name
        case.dummy = True
        if dims is not None:  # the case model read the config's dtype, not the test's float64
            case.moe = (*dims[:3], 8)
        assert torch.equal(case.piece(0, ids), vllm)  # the vLLM runners' dummy runs take it
        assert dims is None or case.workspace is not None


def test_the_reference_cases_profiling_forward_is_vllms_layers_and_its_fa3_splits_are_given(monkeypatch):
    """The reference decode step's dummy runs take vLLM's eager layers over its weights
    (engine_layers.reference_forward: its own profile_hidden's hidden states, in float64 to
    ~1e-7), for the EAGLE case's target too; and ``ReferenceConfig.fa3_splits`` reaches FA3's
    scheduler metadata and its calls (vLLM's FULL graphs pass 32: fit_bench gives the reference
    the splits it gives the transformers cases; 0, FA3's heuristic, by default)."""
    pytest.importorskip("torch")
    import dataclasses

    import torch

    from capture_plan.references.decode import ReferenceConfig, ReferenceModel
    from capture_plan.schemas.spec import Model
    from capture_plan.tests.engines import engine_layers
    from capture_plan.tests.engines.case_model import CaseModel

    model = Model(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=100)
    ref = ReferenceModel(ReferenceConfig(model=model, max_bs=2, max_seqlen=8), backend="torch", device="cpu")
    gen = torch.Generator().manual_seed(0)
    for d in [*ref.layers, ref.__dict__]:  # float64, norms that count
        for k, t in list(d.items()):
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                d[k] = torch.randn(t.shape, generator=gen, dtype=torch.float64) * (0.5 if t.dim() > 1 else 1.0)
    ids = torch.tensor([5, 7, 9, 11, 3] * 40)
    ours, theirs = engine_layers.reference_forward(ref, ids), ref.profile_hidden(ids)
    assert torch.allclose(ours, theirs, rtol=2e-6, atol=2e-6)
    case = CaseModel(ref, len(ids))
    case.dummy = True
    assert case.reference is ref and torch.equal(case.piece(0, ids), ours)

    seen = []

    class FA3:  # records what the reference passes; the attention's values do not matter here
        @staticmethod
        def get_scheduler_metadata(*args, **kw):
            seen.append(("metadata", kw["num_splits"]))
            return torch.zeros(4, dtype=torch.int32)

        @staticmethod
        def flash_attn_with_kvcache(q, *args, **kw):
            seen.append(("attention", kw["num_splits"]))
            return torch.zeros_like(q)

    for splits in (0, 32):
        r = ReferenceModel(
            dataclasses.replace(ReferenceConfig(model=model, max_bs=2, max_seqlen=8), fa3_splits=splits),
            backend="torch",
            device="cpu",
        )
        r.fa3, seen[:] = FA3, []
        workspace = torch.zeros(64, dtype=torch.uint8)
        r.refresh("decode", 2, 2, workspace)
        r.run("decode", 2, workspace)
        assert seen == [("metadata", splits)] + [("attention", splits)] * model.layers
