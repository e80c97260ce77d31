"""`planner fit`: the KV geometry per layer type, each release's rule, refusals.

fit against the published start-up logs (tests/data/engine_logs) is tests/test_fit_logs.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from capture_plan.planner.cli import main
from capture_plan.planner.fit import sizing
from capture_plan.planner.fit.fit import FitRequest, fit
from capture_plan.planner.fit.model import kv_bytes_per_token, load_model, weight_bytes
from capture_plan.planner.fit.tables import GiB, estimates, rule_for, rules, wheels
from capture_plan.schemas.fit import FitItem, FitResult

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "planner/data/configs"


def cfg(name: str):
    return load_model(str(CONFIGS / f"{name}.json"))


def run(*args: str, capsys) -> tuple[int, str, str]:
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def run_fix(err: str, capsys) -> tuple[int, str, str]:
    """The command a one-line refusal's fix names (between backticks), run."""
    import shlex

    argv = shlex.split(err.split("`")[1])
    assert argv[:2] == ["planner", "fit"], err
    return run(*argv[1:], capsys=capsys)


def model_arg(name: str) -> str:
    """``--model``'s value: a preset as it is, a worked example's name as its config.json."""
    return name if name == "llama-3-8b" else str(CONFIGS / f"{name}.json")


def fit_cli(model: str, device: str, engine: str, *more: str, capsys) -> tuple[int, str, str]:
    """``planner fit --model MODEL --device DEVICE --engine ENGINE MORE...`` (:func:`model_arg`)."""
    return run("fit", "--model", model_arg(model), "--device", device, "--engine", engine, *more, capsys=capsys)


def test_kv_bytes_per_token_per_layer_type():
    # Llama-3.1-8B: 8 KV heads x (128 + 128) x 2 bytes; tp 2 halves the heads, fp8 the element
    llama = cfg("llama-3.1-8b")
    assert kv_bytes_per_token(llama, 1, 2) == 4096
    assert kv_bytes_per_token(llama, 2, 2) == 2048 and kv_bytes_per_token(llama, 1, 1) == 2048
    assert kv_bytes_per_token(llama, 16, 2) == 512  # one head per rank, replicated past 8
    # DeepSeek-V2-Lite caches MLA's latent: (512 + 64) x 2, the same on every rank
    ds = cfg("deepseek-v2-lite")
    assert ds.mla and kv_bytes_per_token(ds, 1, 2) == 1152 == kv_bytes_per_token(ds, 4, 2)
    # Gemma-2: every other layer slides (transformers Gemma2DecoderLayer), window 4096
    gemma = cfg("gemma-2-9b")
    assert (gemma.sliding_layers, gemma.full_layers, gemma.sliding_window) == (21, 21, 4096)
    # Qwen2.5 names a window but switches it off
    assert cfg("qwen2.5-7b").sliding_layers == 0


def test_weights_match_the_published_loading_figures():
    # vLLM logs "Model loading took 14.99 GiB" for Llama-3.1-8B on one GPU (bf16)
    assert round(weight_bytes(cfg("llama-3.1-8b"), 1) / GiB, 2) == 14.99
    # an MoE's experts and an fp8 checkpoint count as the config says
    assert 56 < weight_bytes(cfg("qwen3-30b-a3b"), 1) / GiB < 58


def test_weights_are_exact_only_from_an_index_on_one_rank(tmp_path):
    """Counted from the config: estimated, +-0.5%. From a safetensors index: exact at tp 1;
    split over tp with the replicated norms whole on each rank, estimated, their bytes the bar."""
    from capture_plan.planner.fit.model import replicated_bytes

    flags = {"max-model-len": 8192}
    counted = _item(fit(FitRequest(cfg("llama-3.1-8b"), "H100", "vllm==0.34.0", 1, flags)), "weights")
    assert counted.status == "estimated" and counted.error_bytes == int(0.005 * counted.bytes)
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {"total_size": 16_060_522_496}, "weight_map": {}}))
    llama = load_model(str(CONFIGS / "llama-3.1-8b.json"), index)
    one = _item(fit(FitRequest(llama, "H100", "vllm==0.34.0", 1, flags)), "weights")
    rope = 131072 * 128 * 2  # the rotary cache beside the checkpoint: max_position_embeddings x head_dim, bf16
    assert (one.status, one.bytes, one.error_bytes) == ("exact", 16_060_522_496 + rope, 0)
    # vLLM's "Model loading took 14.99 GiB" holds the cache: the index alone is 14.96 GiB
    assert round(one.bytes / GiB, 2) == 14.99 != round(16_060_522_496 / GiB, 2)
    two = _item(fit(FitRequest(llama, "H100", "vllm==0.34.0", 2, flags)), "weights")
    rep = replicated_bytes(llama)
    assert rep == (2 * 32 + 1) * 4096 * 2  # 64 layer norms and the final one, bf16
    assert (two.status, two.bytes, two.error_bytes) == ("estimated", (16_060_522_496 - rep) // 2 + rep + rope, rep)


@pytest.mark.parametrize(("engine", "element"), [("vllm==0.34.0", 2), ("sglang==0.5.23", 4)])
@pytest.mark.parametrize("tp", [1, 2])
def test_an_index_and_the_config_count_the_same_rotary_cache(tmp_path, engine, element, tp):
    """--weights-index gives the checkpoint's bytes; the engine's rotary cos/sin cache is in no
    checkpoint, so both paths add it, in the engine's element (vLLM the model's dtype, SGLang
    float32): an index whose total is the parameters fit counts gives the counted figure (the
    index path dropped SGLang's float32 cache, and vLLM's)."""
    flags = {"max-model-len" if engine.startswith("vllm") else "context-length": 8192}
    llama = cfg("llama-3.1-8b")
    params = weight_bytes(msgspec.structs.replace(llama, max_positions=0), 1)
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {"total_size": params}, "weight_map": {}}))
    counted = _item(fit(FitRequest(llama, "H100", engine, tp, flags)), "weights")
    indexed = load_model(str(CONFIGS / "llama-3.1-8b.json"), index)
    exact = _item(fit(FitRequest(indexed, "H100", engine, tp, flags)), "weights")
    assert exact.bytes == counted.bytes, (exact.source, counted.source)
    assert f"({131072 * 128 * element} bytes)" in exact.source


def test_vllm_034_sizing_follows_measure_kv_cache_bytes():
    rule = rules()["vllm-extensible"]
    # 10 GiB free after warm-up and capture, nothing committed, a 2 GiB transient peak:
    # margin max(1 GiB, 1.5 GiB); min(budget - used, free - margin) - peak
    init_free, weights, other, graph, peak = 80 * GiB, 60 * GiB, 9 * GiB, 1 * GiB, 2 * GiB
    got = sizing.vllm_after_capture(
        rule, 80 * GiB, init_free, weights=weights, non_torch=other, activation=peak, graph=graph
    )
    assert got == 10 * GiB - int(1.5 * GiB) - peak
    # an explicit utilization caps it instead
    got = sizing.vllm_after_capture(
        rule, 75 * GiB, init_free, weights=weights, non_torch=other, activation=peak, graph=graph
    )
    assert got == 75 * GiB - 70 * GiB - peak


def test_vllm_blocks_count_sliding_groups_as_the_manager_does():
    gemma = cfg("gemma-2-9b")
    page = 16 * 8192
    blocks, conc, tokens = sizing.vllm_blocks(gemma, 8192, 16, 1000 * 21 * page, 8192, 16384)
    # one full group (512 blocks a request) and one sliding group (min(4095 + 16384, 8192) / 16 + 1)
    assert blocks == 1000 and conc == pytest.approx(1000 / (512 + 513)) and tokens == int(conc * 8192)
    # 13 full + 12 sliding: 13 < 1.5 x 12, so groups of 13 (the sliding group padded to 13), one of each
    # type (vllm/v1/core/kv_cache_planning.py: max_num_layers < min_num_layers * 1.5)
    odd = msgspec.structs.replace(gemma, layers=25, sliding_layers=12)
    blocks, conc, _ = sizing.vllm_blocks(odd, 8192, 16, 1000 * 13 * page, 8192, 16384)
    assert blocks == 1000 and conc == pytest.approx(1000 / (512 + 513))
    # 21 + 21 and 12 sliding + 24 full (24 >= 18) keep the smallest count
    wide = msgspec.structs.replace(gemma, layers=36, sliding_layers=12)
    blocks, conc, _ = sizing.vllm_blocks(wide, 8192, 16, 1000 * 12 * page, 8192, 16384)
    assert blocks == 1000 and conc == pytest.approx(1000 / (2 * 512 + 513))


def test_each_release_follows_its_rule_and_sizes_as_its_kind_says():
    """Each release file's fit rule is the one fit takes for it (planner/data/releases/)."""
    from capture_plan.planner.inputs.releases import releases

    for f in releases():
        assert rule_for(f"{f.engine}=={f.version}")[2] == f.fit_rule
    llama = cfg("llama-3.1-8b")
    r33 = fit(FitRequest(llama, "H100", "vllm==0.33.0", 1, {"max-model-len": 8192}))
    r34 = fit(FitRequest(llama, "H100", "vllm==0.34.0", 1, {"max-model-len": 8192}))
    assert r33.settings["gpu-memory-utilization"] == 0.92 and r34.settings["gpu-memory-utilization"] == 1.0
    # 0.34 sizes after capture from the whole device: more tokens than 0.33's 92%
    assert r34.kv_tokens > r33.kv_tokens > 0
    assert r33.kv_tokens == r33.kv_blocks * 16  # 8192 is a multiple of the block


def test_sglang_defaults_follow_the_memory_hook():
    # H100 (81559 MiB): 512 + 8192 * 1.5 + 128 + 256 * 2 + 58 prefill graphs * 8 = 13904 MiB
    assert sizing.sglang_mem_fraction(81559, 1, 8192, 256, 58, False) == round((81559 - 13904) / 81559, 3)
    assert len(sizing.sglang_prefill_sizes(8192)) == 58
    assert sizing.sglang_defaults(81559, 1) == (8192, 256) and sizing.sglang_defaults(81559, 4) == (8192, 512)
    r = fit(FitRequest(cfg("llama-3.1-8b"), "H100", "sglang==0.5.23", 1, {"context-length": 8192}))
    assert r.settings["mem-fraction-static"] == 0.83 and r.kv_tokens == r.kv_blocks
    # the KV cache item cites the pool's own step, whatever steps the rule lists above it
    kv = next(i for i in r.items if i.name == "KV cache")
    assert "_profile_available_bytes: rest" in kv.source


def test_sglang_without_prefill_graphs_reserves_none_for_them():
    """--disable-prefill-cuda-graph (SGLang's flag): reserve_for_graph_mb loses its prefill term, 58
    sizes x 8 MiB on an H100 (13440 MiB reserved: 0.835), and for an MLA model its 1536 MiB
    (DeepSeek-V2-Lite: 512 + 12288 + 128 + 512 = 13440 as well, against 14976 with them: 0.816);
    no prefill graph is priced. Fails before: fit had no such flag."""
    for name, before in (("llama-3.1-8b", 0.83), ("deepseek-v2-lite", 0.816)):
        flags = {"context-length": 8192}
        with_graphs = fit(FitRequest(cfg(name), "H100", "sglang==0.5.23", 1, flags))
        without = fit(FitRequest(cfg(name), "H100", "sglang==0.5.23", 1, {**flags, "disable-prefill-cuda-graph": True}))
        assert with_graphs.settings["mem-fraction-static"] == before, name
        assert without.settings["mem-fraction-static"] == 0.835 and without.settings["disable-prefill-cuda-graph"]
        assert without.kv_tokens > with_graphs.kv_tokens
        graph = {r.name: r for r in without.items}["graph memory"]
        assert "prefill" not in graph.source, graph.source


def test_sglang_graphs_and_activations_must_fit_the_slack_alone():
    """The pool takes pre-load free x mem-fraction-static less the weights and non-torch
    (kv_cache_configurator._profile_available_bytes measures free memory after both), so the
    graphs and the activation peak fit in pre-load free x (1 - fraction): non-torch is not
    taken from that slack again."""
    llama = cfg("llama-3.1-8b")
    flags = {"context-length": 8192, "mem-fraction-static": 0.9}
    r = fit(FitRequest(llama, "H100", "sglang==0.5.23", 1, flags))
    pre = _item(r, "device total").bytes - _item(r, "CUDA context").bytes
    slack = int(pre * (1 - 0.9))
    room = slack - _item(r, "activation peak").bytes
    assert _item(r, "non-torch memory").bytes > 0
    for graph, fits in ((room, True), (room + 1, False)):
        given = FitItem("graph memory", graph, 0, "given", "test")
        assert fit(FitRequest(llama, "H100", "sglang==0.5.23", 1, flags, given)).fits is fits


def test_sglang_slack_fixes_name_the_fraction_and_batch_size_that_fit(capsys):
    """Fails before: the fixes were the fraction less 0.05 and half the batch size, which at a
    fraction of 0.99 (or a batch size many halvings too large) do not fit, so fit said none of
    its single changes fits. Now: the largest fraction whose slack holds the graphs and the
    activations, and the largest halved --cuda-graph-max-bs that fits (the first kept); each
    fix's command fits, and the next size up does not."""
    args = ("llama-3.1-8b", "H100", "sglang==0.5.23", "--context-length", "8192")
    code, _, err = fit_cli(*args, "--chunked-prefill-size", "16384", "--mem-fraction-static", "0.99", capsys=capsys)
    assert code == 1 and "exceed the" in err and "none of fit's" not in err, err
    fix = fixes_of(err)[0]
    assert fix.startswith("--mem-fraction-static 0.9") and run_fix(err, capsys)[0] == 0, err
    code, _, err = fit_cli(*args, "--mem-fraction-static", "0.95", "--cuda-graph-max-bs", "2048", capsys=capsys)
    halved = [f for f in fixes_of(err) if f.startswith("--cuda-graph-max-bs ")]
    assert code == 1 and len(halved) == 1, err
    bs = int(halved[0].split()[1])
    for size, rc in ((bs, 0), (bs * 2, 1)):
        assert fit_cli(*args, "--mem-fraction-static", "0.95", "--cuda-graph-max-bs", str(size), capsys=capsys)[0] == rc


def test_a_fix_the_engine_refuses_does_not_hide_the_answer(capsys):
    """Fails before: checking the --tp fixes, fit asked SGLang's default fraction at --tp 32
    (-0.001, refused), and that refusal escaped as the answer to the user's own settings, whose
    default fraction (0.16) is valid. The answer is theirs: the weights leave no KV cache."""
    more = ("--chunked-prefill-size", "12288", "--cuda-graph-max-bs", "512")
    code, _, err = fit_cli("llama-3.1-8b", "4090", "sglang==0.5.23", *more, capsys=capsys)
    assert code == 1 and err.count("\n") == 1, err
    assert "leave no KV cache under mem-fraction-static 0.16" in err and "memory_hook" not in err, err


def test_vllms_defaulted_batch_limits_cap_each_other_and_a_refused_pair_is_one_line(capsys):
    """vllm/engine/arg_utils.py _set_default_max_num_seqs_and_batched_tokens_args: a defaulted
    max_num_seqs is capped at the batched tokens (fails before: fit kept 1024 sequences, their
    buffers, beside 256 batched tokens), defaulted batched tokens at max_num_seqs x
    max_model_len; SchedulerConfig refuses batched tokens below max_num_seqs, so fit does too,
    with a fix whose command fits."""
    r = _llama("vllm==0.34.0", **{"max-num-batched-tokens": 256, "max-model-len": 8192})
    assert (r.settings["max-num-seqs"], r.settings["max-num-batched-tokens"]) == (256, 256)
    r = _llama("vllm==0.34.0", **{"max-num-seqs": 8, "max-model-len": 4})
    assert (r.settings["max-num-seqs"], r.settings["max-num-batched-tokens"]) == (8, 32)
    more = ("--max-model-len", "8192", "--max-num-batched-tokens", "256", "--max-num-seqs", "1024")
    code, _, err = fit_cli("llama-3.1-8b", "H100", "vllm==0.34.0", *more, capsys=capsys)
    assert code == 1 and err.count("\n") == 1 and "must be greater than or equal to max_num_seqs" in err, err
    assert "--max-num-seqs 256" in err and run_fix(err, capsys)[0] == 0, err


def test_the_kv_error_bar_sums_the_items_the_rule_takes_it_from():
    """The KV item's error bar is the sum of the error bars of the named items its rule
    subtracts: before capture the budget, weights, non-torch, the engine's buffers (unknown, so
    none, for a release not read for them: 0.19.0), the peak (and the graphs where deducted);
    after capture the same with the graphs and torch's reserve growth, the budget side or, where
    the free side binds, the device total and the CUDA context; SGLang: its pool's."""

    def bar(r, *names):
        return sum(_item(r, n).error_bytes or 0 for n in names)

    taken = ("weights", "non-torch memory", "engine buffers", "activation peak")
    r = _llama("vllm==0.33.0")  # before capture, graphs deducted
    assert _item(r, "KV cache").error_bytes == bar(r, "engine budget", *taken, "graph memory")
    r = _llama("vllm==0.19.0")  # before capture, graphs logged only
    assert _item(r, "KV cache").error_bytes == bar(r, "engine budget", *taken)
    after = (*taken, "graph memory", "torch reserve growth")  # and the sizing step's growth
    r = _llama("vllm==0.34.0")  # after capture, utilization 1.0: the free side binds
    assert _item(r, "KV cache").error_bytes == bar(r, "device total", "CUDA context", *after)
    r = _llama("vllm==0.34.0", **{"gpu-memory-utilization": 0.9})  # the budget side binds
    assert _item(r, "KV cache").error_bytes == bar(r, "engine budget", *after)
    r = fit(FitRequest(cfg("llama-3.1-8b"), "H100", "sglang==0.5.23", 1, {"context-length": 8192}))
    assert _item(r, "KV cache").error_bytes == bar(r, "CUDA context", "engine budget", "weights", "non-torch memory")


def test_graph_memory_is_unknown_where_nothing_measured_is_near():
    r = fit(FitRequest(cfg("llama-3.1-8b"), "L40S", "vllm==0.34.0", 1, {"max-model-len": 8192}))
    graph = next(i for i in r.items if i.name == "graph memory")
    assert graph.bytes is None and graph.status == "unknown" and "sm89" in graph.source
    eager = fit(
        FitRequest(cfg("llama-3.1-8b"), "L40S", "vllm==0.34.0", 1, {"max-model-len": 8192, "enforce-eager": True})
    )
    assert next(i for i in eager.items if i.name == "graph memory").bytes == 0


def test_graph_node_counts_are_the_committed_bench():
    bench = json.loads((ROOT / estimates()["graph"]["bench"]).read_text())["cases"]
    assert estimates()["graph"]["nodes"] == {
        n: c["first"][0]["nodes"] for n, c in bench.items() if n in estimates()["graph"]["nodes"]
    }


def test_nodes_per_layer_divide_by_the_bench_models_own_layers():
    """The bench's transformers cases have their config's layers (4 to 8), the reference its
    32: a family's nodes per layer divide its graph's nodes by those (before: every family by
    32, which put llama's at 381 / 32 = 11.9 where its 8-layer graph holds about 48 a layer)."""
    import inspect

    from bench.harness import HF_ARCHS, fitted_target
    from capture_plan.planner.memory.graph_nodes import nodes_per_layer

    g = estimates()["graph"]
    want = {n: kw["num_hidden_layers"] for n, (_, kw, _) in HF_ARCHS.items() if n in g["nodes"]}
    reference = inspect.signature(fitted_target).parameters["layers"].default  # graph_exec_bench's
    assert g["layers"] == {**want, "reference": reference}
    assert nodes_per_layer("llama") == g["nodes"]["llama"] / 8
    assert nodes_per_layer("mistral") == nodes_per_layer("llama")  # a model type maps to its family


def test_sizes_cost_tokens_under_vllm():
    r = fit(FitRequest(cfg("llama-3.1-8b"), "H100", "vllm==0.33.0", 1, {"max-model-len": 8192}))
    cost = {c.name: c for c in r.size_costs}
    assert len(cost["engine default"].sizes) == 51
    assert cost["engine default"].tokens_cost > cost["fewer"].tokens_cost > 0 == cost["none"].tokens_cost


def test_an_unmodelled_release_names_the_nearest(capsys):
    code, _, err = fit_cli("llama-3-8b", "H100", "vllm==0.18.0", capsys=capsys)
    assert code == 1 and "--engine vllm==0.19.0" in err and err.count("\n") == 1
    code, _, err = fit_cli("llama-3-8b", "H100", "vllm==0.20.1", capsys=capsys)
    assert code == 1 and "--engine vllm==0.20.0" in err and err.count("\n") == 1
    # a later major: the newest modelled release, not the one whose minor number is closest
    # (before: vllm==9.9 named 0.19.0)
    code, _, err = fit_cli("llama-3-8b", "H100", "vllm==9.9", capsys=capsys)
    assert code == 1 and "--engine vllm==0.34.0" in err and err.count("\n") == 1
    # spaces around the name or the version are not part of it (a release is never refused naming itself)
    for engine in ("vllm==0.34.0 ", " vllm == 0.34.0", "sglang==0.5.23\t"):
        assert rule_for(engine)[:2] == tuple(engine.strip().replace(" ", "").split("=="))
    code, _, err = fit_cli("llama-3-8b", "TPU", "vllm==0.34.0", capsys=capsys)
    assert code == 1 and "NVIDIA H100 80GB HBM3" in err


def test_does_not_fit_names_the_item_and_fixes_that_work(capsys):
    args = ("qwen3-30b-a3b", "RTX 4090", "vllm==0.34.0")
    code, out, err = fit_cli(*args, capsys=capsys)
    assert code == 1 and "weights" in err and "fix: --tp 4" in err
    code, out, _ = fit_cli(*args, "--tp", "4", capsys=capsys)
    assert code == 0, out
    code, _, err = fit_cli("llama-3.1-8b", "RTX 4090", "vllm==0.34.0", "--max-model-len", "60000", capsys=capsys)
    fix = fixes_of(err)[0]
    assert code == 1 and fix.startswith("--max-model-len ")
    code, _, _ = fit_cli("llama-3.1-8b", "RTX 4090", "vllm==0.34.0", *fix.split(), capsys=capsys)
    assert code == 0
    # the first fix is also given as the whole command, which runs (before: only its flags)
    assert f"{fix}: `planner fit " in err and run_fix(err, capsys)[0] == 0, err


def fixes_of(err: str) -> list[str]:
    """The fixes a does-not-fit line names: the first (with its command), then the others."""
    text = err.split("; fix: ", 1)[1].strip()
    first, _, rest = text.partition(": `")
    more = rest.split("` (or ", 1)[1].removesuffix(")").split(" or ") if "` (or " in rest else []
    return [first, *more]


#: configurations whose budget flag starves the cache (the flag named is the user's)
STARVED = (
    ("llama-3.1-8b", "H100", "vllm==0.34.0", "--gpu-memory-utilization", "0.1"),
    ("llama-3.1-8b", "H100", "vllm==0.33.0", "--gpu-memory-utilization", "0.1"),
    ("llama-3.1-8b", "H100", "vllm==0.19.0", "--gpu-memory-utilization", "0.2"),
    ("qwen2.5-7b", "H200", "vllm==0.34.0", "--gpu-memory-utilization", "0.1"),
    # an MoE model: the fused-MoE workspace, an item of its own in 0.33.0 and 0.34.0, is taken
    # from the budget too (the budget fix left it out, so the value it named did not fit and
    # was dropped, leaving --tp 2 alone)
    ("qwen3-30b-a3b", "H100", "vllm==0.33.0", "--gpu-memory-utilization", "0.74"),
    ("qwen3-30b-a3b", "H100", "vllm==0.34.0", "--gpu-memory-utilization", "0.74"),
    ("llama-3.1-8b", "H100", "sglang==0.5.23", "--mem-fraction-static", "0.01"),
    ("llama-3.1-8b", "H100", "sglang==0.5.23", "--mem-fraction-static", "0.2"),
    ("qwen2.5-7b", "H200", "sglang==0.5.23", "--mem-fraction-static", "0.1"),
)


@pytest.mark.parametrize("case", STARVED, ids=lambda c: f"{c[0]}-{c[2]}-{c[4]}")
def test_every_fix_for_a_starved_budget_fits(case, capsys):
    """Each suggested fix, applied to the command, fits (rc 0); the user's budget flag is
    suggested at the value that fits."""
    model, device, engine, flag, value = case
    args = (model, device, engine)
    code, _, err = fit_cli(*args, flag, value, capsys=capsys)
    assert code == 1 and err.count("\n") == 1
    fixes = fixes_of(err)
    assert fixes[0].startswith(flag + " ")
    for fix in fixes:
        words = fix.split()
        given = (flag, value) if words[0] != flag else ()
        code, _, err = fit_cli(*args, *given, *words, capsys=capsys)
        assert code == 0, (fix, err)


def test_a_tp_the_engines_refuse_is_refused_naming_those_that_work(capsys):
    """vLLM (verify_with_parallel_config) and SGLang refuse attention heads that --tp does not
    divide: Qwen3-30B-A3B's 32 heads at --tp 64 or 3 are refused naming the divisors; the
    largest of them, 32, is not refused."""
    for engine in ("vllm==0.34.0", "sglang==0.5.23"):
        for tp in ("64", "3"):
            code, _, err = fit_cli("qwen3-30b-a3b", "H200", engine, "--tp", tp, capsys=capsys)
            assert code == 1 and err.count("\n") == 1
            assert f"--tp {tp} does not divide" in err and "fix: one of 1, 2, 4, 8, 16, 32: `planner fit" in err
            code, _, fixed = run_fix(err, capsys)  # the largest divisor below the --tp given
            assert code == 0 and f"--tp {32 if tp == '64' else 2}`" in err, fixed
        code, _, err = fit_cli("qwen3-30b-a3b", "H200", engine, "--tp", "32", capsys=capsys)
        assert "does not divide" not in err


def test_json_is_the_versioned_schema(capsys):
    from capture_plan.schemas.fit import FitResult

    code, out, _ = fit_cli("llama-3-8b", "H200", "sglang==0.5.23", "--context-length", "8192", "--json", capsys=capsys)
    assert code == 0 and msgspec.json.decode(out, type=FitResult).schema_version == 3
    code, out, _ = run("schema", "fit", capsys=capsys)
    assert code == 0 and "FitResult" in out and "FitTraffic" in out and "padding_pct" in out


def test_every_rule_field_is_read():
    """A rule's field no code reads is dead data: each is read as ``.field`` by fit's modules."""
    from capture_plan.planner.fit.tables import Rule

    code = "".join(p.read_text() for p in (ROOT / "planner/fit").glob("*.py"))
    assert [f for f in msgspec.structs.fields(Rule) if f".{f.name}" not in code] == []


def test_every_modelled_release_names_its_wheel():
    """Each release a rule covers was read from a wheel whose sha256 is committed."""
    for name, rule in rules().items():
        for version in rule.releases:
            assert len(wheels()[f"{rule.engine}=={version}"].sha256) == 64, (name, version)
    covered = [v for r in rules().values() if r.engine == "vllm" for v in r.releases]
    assert len(covered) == len(set(covered))  # one rule per release
    assert {f"0.{m}.0" for m in range(19, 35)} <= set(covered)


def _llama(engine: str, **flags):
    return fit(FitRequest(cfg("llama-3.1-8b"), "H100", engine, 1, {"max-model-len": 8192, **flags}))


def _item(r, name: str):
    return next(i for i in r.items if i.name == name)


def test_vllm_019_logs_the_graph_estimate_and_020_deducts_it():
    r19, r20 = _llama("vllm==0.19.0"), _llama("vllm==0.20.0")
    assert r19.settings["gpu-memory-utilization"] == 0.9 and r20.settings["gpu-memory-utilization"] == 0.92
    same19, same20 = (_llama(v, **{"gpu-memory-utilization": 0.9}) for v in ("vllm==0.19.0", "vllm==0.20.0"))
    graph = _item(same20, "graph memory").bytes
    assert graph and same19.kv_bytes - same20.kv_bytes == graph
    # 0.19.0: the capture sizes cost no KV tokens (the estimate is not deducted)
    assert {c.name: c.tokens_cost for c in r19.size_costs}["engine default"] == 0
    assert any("not take it from the KV budget" in n for n in r19.notes)


def test_vllm_tokens_are_counted_as_each_release_logs_them(monkeypatch):
    # Gemma-2: two KV groups (21 full, 21 sliding). 0.20.0 logs num_blocks // 2 groups x 16;
    # 0.21.0 int(concurrency x max_model_len), which counts the window's smaller share
    gemma = cfg("gemma-2-9b")
    flags = {"max-model-len": 8192, "gpu-memory-utilization": 0.92}
    r20 = fit(FitRequest(gemma, "H100", "vllm==0.20.0", 1, flags))
    r21 = fit(FitRequest(gemma, "H100", "vllm==0.21.0", 1, flags))
    assert r20.kv_blocks == r21.kv_blocks and r20.kv_tokens == r20.kv_blocks // 2 * 16
    assert r21.kv_tokens == int(r21.kv_blocks / (512 + 513) * 8192)  # window 4095 + 8192 in flight > 8192
    # 0.25.0 holds max_num_batched_tokens beyond the window, 0.26.0 two batches (async scheduling);
    # 32768 is past Gemma-2's 8192: vLLM takes it only under VLLM_ALLOW_LONG_MAX_MODEL_LEN, and so does fit
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    small = {"max-model-len": 32768, "gpu-memory-utilization": 0.92}
    r25 = fit(FitRequest(gemma, "H100", "vllm==0.25.0", 1, small))
    r26 = fit(FitRequest(gemma, "H100", "vllm==0.26.0", 1, small))
    per25 = 2048 + (-(-(4095 + 8192) // 16) + 1)
    per26 = 2048 + (-(-(4095 + 16384) // 16) + 1)
    assert r25.max_concurrency == round(r25.kv_blocks / per25, 2)
    assert r26.max_concurrency == round(r26.kv_blocks / per26, 2)


def test_vllm_default_capture_sizes_follow_each_release():
    def sizes(engine, **flags):
        return _llama(engine, **flags).settings["cudagraph-capture-sizes"].split(",")

    # max_num_batched_tokens 300 < 512 caps the grid; 0.21.0 on appends it
    assert "300" not in sizes("vllm==0.20.0", **{"max-num-batched-tokens": 300})
    assert sizes("vllm==0.21.0", **{"max-num-batched-tokens": 300})[-1] == "300"
    # max_num_batched_tokens caps a given --max-cudagraph-capture-size and drops given sizes above it
    # (0.33.0, 0.34.0: _set_cudagraph_sizes' min(max_num_tokens, max_cudagraph_capture_size))
    capped = sizes("vllm==0.34.0", **{"max-num-batched-tokens": 300, "max-cudagraph-capture-size": 512})
    assert capped[-1] == "300" and "512" not in capped
    given = {"max-num-batched-tokens": 600, "cudagraph-capture-sizes": [1, 2, 4, 512, 1024]}
    assert sizes("vllm==0.33.0", **given) == ["1", "2", "4", "512"]
    # the uniform decode size max_num_seqs: appended from 0.31.0
    assert "100" not in sizes("vllm==0.30.0", **{"max-num-seqs": 100})
    assert "100" in sizes("vllm==0.31.0", **{"max-num-seqs": 100})
    # the >= 160 GiB batch tier from 0.28.0 (no device in the table has that much)
    assert sizing.vllm_batch_defaults(180 * GiB, "B200", False) == (1024, 8192)
    assert sizing.vllm_batch_defaults(180 * GiB, "B200", True) == (1024, 16384)
    assert rules()["vllm-0-26"].batch_tier_160 is False and rules()["vllm-0-28"].batch_tier_160 is True


def test_the_fit_page_is_generated_and_current():
    """docs/fit.md's tables (the rules, the worked examples, one whole answer) are what
    docs/generate.py renders from fit_rules.toml and fit itself."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("docs_generate", ROOT / "docs/generate.py")
    assert spec is not None and spec.loader is not None
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    page = ROOT / "docs/fit.md"
    assert page.read_text() == gen.render_tables(page.read_text(), "docs/fit.md"), "fix: python docs/generate.py"


def test_engine_flags_are_one_table_the_cli_and_checks_derive_from(capsys):
    """Each row of fit_flags.toml is a CLI option of its type, and its bounds are checked
    for both engines from the row (no bounds at call sites)."""
    from capture_plan.planner.cli.fit import command
    from capture_plan.planner.fit.flags import engine_flags
    from capture_plan.planner.fit.model import KV_DTYPES

    options = {p.name.replace("_", "-") for p in command.params}
    assert set(engine_flags()) <= options
    assert engine_flags()["kv-cache-dtype"].choices == list(KV_DTYPES)
    for engine, flag in (("vllm==0.34.0", "--block-size"), ("sglang==0.5.23", "--page-size")):
        code, _, err = fit_cli("llama-3.1-8b", "H100", engine, flag, "0", capsys=capsys)
        assert code == 1 and f"{flag}: {flag} must be an integer from 1 to" in err and err.count("\n") == 1
    code, _, err = fit_cli("llama-3.1-8b", "H100", "sglang==0.5.23", "--block-size", "32", capsys=capsys)
    assert code == 1 and "sglang has no flag --block-size" in err


@pytest.mark.parametrize("engine", ["vllm==0.34.0", "sglang==0.5.23"])
def test_an_integer_flag_out_of_its_bounds_suggests_a_value_that_works(capsys, engine):
    """Every integer flag of the engine, given 0: one line whose fix is a value (the row's
    example), and fit with that value answers. Before: "give --max-num-seqs a value in that
    range", no value to give."""
    from capture_plan.planner.fit.flags import engine_flags

    ints = [n for n, f in engine_flags().items() if f.type == "int" and engine.split("==")[0] in f.engines]
    assert len(ints) >= 4
    for name in ints:
        code, _, err = fit_cli("llama-3.1-8b", "H100", engine, f"--{name}", "0", capsys=capsys)
        assert code == 1 and err.count("\n") == 1 and "; fix: a value in bounds: `planner fit " in err, err
        assert f" --{name} {engine_flags()[name].example}`" in err, err
        assert run_fix(err, capsys)[0] == 0, (name, err)


def test_engine_help_names_every_modelled_release(capsys):
    code, out, _ = run("fit", "--help", capsys=capsys)
    text = " ".join(out.split())
    assert code == 0 and "vllm==0.19.0 to vllm==0.34.0 or sglang==0.5.23" in text


PLAN = ROOT / "plans/fa3-ci-h200.json"
CALIBRATION = ROOT / "plans/calibration/h200-fa3-ci.json"
_PLANNED = ("fit", "--model", "llama-3-8b", "--engine", "vllm==0.34.0", "--max-model-len", "8192", "--json")


def _fit_json(capsys, *args: str):
    code, out, err = run(*_PLANNED, *args, capsys=capsys)
    assert code == 0, err
    return msgspec.json.decode(out, type=FitResult)


def test_a_plans_sizes_and_pool_replace_the_engine_defaults(capsys):
    from capture_plan.schemas.codec import decode_plan

    plan = decode_plan(PLAN.read_bytes(), str(PLAN))
    bare = _fit_json(capsys, "--device", "H200")
    r = _fit_json(capsys, "--device", "H200", "--plan", str(PLAN))
    sizes = sorted({s for p in plan.phases for s in p.sizes})
    assert r.settings["cudagraph-capture-sizes"] == ",".join(map(str, sizes))
    graph = _item(r, "graph memory")
    # the plan's predicted pool is the figure's pool; graph-exec and the workspace are estimated
    assert graph.status == "estimated" and "plan fa3-ci-h200's predicted pool" in graph.source
    assert graph.bytes is not None and graph.bytes > plan.predicted.pool_bytes + plan.predicted.hoisted_bytes
    costs = {c.name: c for c in r.size_costs}
    assert list(costs) == ["engine default", "plan", "fewer", "none"]
    assert costs["plan"].sizes == sizes and costs["plan"].graph_bytes == graph.bytes
    assert costs["plan"].tokens_cost == costs["none"].kv_tokens - r.kv_tokens > 0
    # the engine default's sizes are still priced as without the plan
    assert costs["engine default"] == {c.name: c for c in bare.size_costs}["engine default"]
    # the plan's graphs are captured whole, so vLLM's FA3 split-KV accumulators are in their
    # pool at each attention call; the planner's FA3 backend simulates none, so fit adds what
    # they add to the simulated pool (before: the plan's figure left them out, and the fit
    # bench's plan column ran 46-61% under): at most the accumulators' block at the largest
    # size, less where the layer's later temporaries reuse it. And vLLM 0.34.0 makes its
    # persistent hidden states (largest size x hidden, model dtype) inside its capture's
    # window, a segment of their own (cudagraph_utils.py persistent_like)
    m = load_model("llama-3-8b")
    accum = 4 * 32 * m.heads * max(sizes) * (m.v_head_dim + 1)  # fit_estimates.toml [graph.vllm_split_kv]
    assert "split-KV accumulators" in graph.source and "persistent hidden states" in graph.source
    growth = graph.bytes - _plan_graph_bytes(plan, r) - _hidden_states_segment(plan)
    assert 0 < growth <= accum + (2 << 20) and growth % (2 << 20) == 0
    # a plan of another model is refused, one line naming the plan's model
    code, _, err = run(
        *_PLANNED[:2],
        str(CONFIGS / "qwen2.5-7b.json"),
        *_PLANNED[3:],
        "--device",
        "H200",
        "--plan",
        str(PLAN),
        capsys=capsys,
    )
    assert code == 1 and "--model the plan's model (llama-3-8b)" in err and err.count("\n") == 1


def _hidden_states_segment(plan) -> int:
    """The caching allocator's segment for the llama-3-8b plan's largest size x hidden bf16
    hidden states: 20 MiB under 10 MiB, else the request rounded up to 2 MiB."""
    n = max(s for p in plan.phases for s in p.sizes) * 4096 * 2
    return 20 << 20 if n < 10 << 20 else -(-n // (2 << 20)) * (2 << 20)


def _plan_graph_bytes(plan, r) -> int:
    """A plan's graph figure without an engine's kernels' temporaries: its pool + hoisted,
    graph-exec of its graphs (nodes x the per-node figure, + the per-graph figure), the
    stream workspace: the parts :func:`capture_plan.planner.fit.estimate.graph_memory` adds."""
    from capture_plan.planner.fit import estimate
    from capture_plan.planner.fit.graph_count import whole_graphs
    from capture_plan.planner.fit.graph_pool import Captures
    from capture_plan.planner.fit.measured import plan_graphs
    from capture_plan.planner.fit.tables import device

    m = load_model("llama-3-8b")
    pg = plan_graphs(plan, "test", m)
    sm = device(r.device)[1].sm
    item = estimate.graph_memory(m, 1, sm, whole_graphs(pg.graphs, "plan"), Captures([]), (pg.pool_bytes, "plan"))
    return item.bytes


@pytest.mark.parametrize("backend", ["flashinfer", "triton"])
def test_a_plan_of_another_backend_gets_no_fa3_accumulators(backend, capsys):
    """A plan whose graphs attend with another backend than FA3 is priced as it predicted:
    vLLM's FA3 split-KV accumulators are not FlashInfer's (none) nor triton's (its own
    splits, which the planner's triton backend simulates)."""
    from capture_plan.schemas.codec import decode_plan

    path = ROOT / f"plans/{backend}.json"  # the checked-in plans of the same model, built with that backend
    other = decode_plan(path.read_bytes(), str(path))
    assert other.requires.backend == backend
    r = _fit_json(capsys, "--device", "H200", "--plan", str(path))
    graph = _item(r, "graph memory")
    assert "split-KV accumulators" not in graph.source
    # vLLM 0.34.0's persistent hidden states, whatever the backend (the test above)
    assert graph.bytes == _plan_graph_bytes(other, r) + _hidden_states_segment(other)
    assert {c.name: c for c in r.size_costs}["plan"].graph_bytes == graph.bytes


def test_a_calibration_gives_the_measured_graph_memory(capsys):
    rep = json.loads(CALIBRATION.read_text())
    drop = rep["device_view"]["drop"]
    r = _fit_json(capsys, "--device", "H200", "--calibration", str(CALIBRATION), "--plan", str(PLAN))
    graph = _item(r, "graph memory")
    # pool + hoisted + graph-exec + workspaces: every item of the report's device view
    assert graph.status == "measured" and graph.bytes == drop
    assert graph.error_bytes == max(2 << 20, drop // 100) and str(CALIBRATION) in graph.source
    assert {c.name: c for c in r.size_costs}["plan"].graph_bytes == drop
    # without --plan the report's graphs (its plan's 36) would stand for the engine default's 51: refused
    code, _, err = run(*_PLANNED, "--device", "H200", "--calibration", str(CALIBRATION), capsys=capsys)
    assert code == 1 and err.count("\n") == 1
    assert "fix: give --plan PLAN, the plan the report was captured from" in err


def test_a_calibration_of_another_device_is_refused_with_a_fix_that_works(capsys):
    planned = ("--plan", str(PLAN), "--calibration", str(CALIBRATION))
    code, _, err = run(*_PLANNED, "--device", "H100", *planned, capsys=capsys)
    assert code == 1 and err.count("\n") == 1 and "measured on 'NVIDIA H200" in err
    # the fix is this command on the device measured, and it runs (before: the bare flag
    # "--device 'NVIDIA H200'", no command)
    assert "fix: fit for the device it measured (or leave --calibration out" in err
    assert "`planner fit --model llama-3-8b --device 'NVIDIA H200' " in err and "--calibration" in err
    code, out, fix_err = run_fix(err, capsys)
    assert code == 0 and msgspec.json.decode(out, type=FitResult).device == "NVIDIA H200", fix_err
    # a calibration captured from another plan than --plan's is refused too
    other = ROOT / "plans/calibration/h200-fa3-eagle-ci.json"
    code, _, err = run(*_PLANNED, "--device", "H200", "--plan", str(PLAN), "--calibration", str(other), capsys=capsys)
    assert code == 1 and err.count("\n") == 1 and "not from" in err


def test_a_model_no_single_change_fits_is_refused_with_a_fix_still(capsys, tmp_path):
    """Found by the fuzz (seed 49, 5,000 examples, test_fuzz_fit_config): Qwen3-30B-A3B with a
    mutated moe_intermediate_size of 26,962 held ~1.9 TB of weights; no --tp its 32 heads
    allowed fit an H100 of 79.11 GiB, fit kept no fix, and the error line ended without one
    ("; fix: "). At 60,000 no --tp fits any device fit knows."""
    config = json.loads((CONFIGS / "qwen3-30b-a3b.json").read_text())
    config["moe_intermediate_size"] = 60000
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    code, out, err = run("fit", "--model", str(path), "--device", "H100", "--engine", "vllm==0.34.0", capsys=capsys)
    assert code == 1 and err.count("\n") == 1 and "the largest item is weights" in err
    assert "; fix: none of fit's single changes fits" in err and "--device" in err
    assert "fixes: none of fit's single changes fits" in out


@pytest.mark.parametrize(
    ("engine", "flag"), [("vllm==0.34.0", "--max-model-len"), ("sglang==0.5.23", "--context-length")]
)
def test_a_model_with_no_context_length_names_the_model_and_a_flag_that_works(capsys, engine, flag):
    """A preset (or a spec's dimensions) has no max_position_embeddings: the line names the
    model, not "the config", and its fix, added, fits."""
    code, _, err = fit_cli("llama-3-8b", "H100", engine, capsys=capsys)
    assert code == 1 and err.count("\n") == 1 and "llama-3-8b gives no context length" in err
    assert f"{flag} 8192`" in err and run_fix(err, capsys)[0] == 0, err


def test_the_help_examples_run(capsys):
    """Each example ``planner fit --help`` shows runs, as a shell runs it from a checkout's root,
    and answers (exit 0); the one under VLLM_ALLOW_LONG_MAX_MODEL_LEN says the engine warns."""
    import os
    import subprocess
    import sys

    code, out, _ = run("fit", "--help", capsys=capsys)
    text = out.split("Examples")[1].split("Options:")[0].replace("\\\n", " ")
    examples = [ln.strip() for ln in text.splitlines() if "planner fit " in ln]
    assert code == 0 and len(examples) >= 4, out
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    for name in ("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN", "SGLANG_IS_IN_CI"):
        env.pop(name, None)  # an example that needs one sets it
    for example in examples:
        done = subprocess.run(["bash", "-c", example], cwd=ROOT, capture_output=True, text=True, env=env)
        assert done.returncode == 0 and done.stdout, (example, done.stderr)
        if example.startswith("VLLM_ALLOW_LONG_MAX_MODEL_LEN=1"):
            assert "VLLM_ALLOW_LONG_MAX_MODEL_LEN is set: the engine takes 65,536 tokens" in done.stdout


@pytest.mark.parametrize(
    ("given", "device"),
    [
        ("h100-80gb", "NVIDIA H100 80GB HBM3"),
        ("a100 40gb", "NVIDIA A100-SXM4-40GB"),
        ("rtx-4090", "NVIDIA GeForce RTX 4090"),
    ],
)
def test_a_device_named_by_its_words_is_that_device(capsys, given, device):
    """``--device h100-80gb`` (each word a part of one device's name) is that device. Before:
    refused as unknown, its fix naming the A100-SXM4-80GB (difflib's closest spelling)."""
    code, out, err = fit_cli("qwen2.5-7b", given, "vllm==0.34.0", "--max-model-len", "8192", capsys=capsys)
    assert code == 0 and out.startswith(f"qwen2.5-7b on {device} x1"), err


@pytest.mark.parametrize(
    ("given", "near", "listed"),
    [
        ("A100", "NVIDIA A100-SXM4-80GB", "names 2 devices: NVIDIA A100-SXM4-80GB; NVIDIA A100-SXM4-40GB"),
        ("h200-141gb", "NVIDIA H200", "NVIDIA L40S; NVIDIA GeForce RTX 4090"),
    ],
)
def test_an_unknown_device_lists_the_known_ones_and_its_fix_is_the_nearest(capsys, given, near, listed):
    """Two devices match ``A100``: one line naming them; none has every word of ``h200-141gb``:
    one line listing the known devices; the fix the device matching most of its words, and that
    command runs."""
    code, _out, err = fit_cli("qwen2.5-7b", given, "vllm==0.34.0", "--max-model-len", "8192", capsys=capsys)
    assert code == 1 and err.count("\n") == 1 and listed in err, err
    assert f"--device '{near}'" in err, err
    assert run_fix(err, capsys)[0] == 0


@pytest.mark.parametrize(
    ("engine", "given", "own"),
    [
        ("vllm==0.34.0", "--context-length", "--max-model-len"),
        ("sglang==0.5.23", "--max-model-len", "--context-length"),
    ],
)
def test_the_other_engines_context_flag_is_refused_naming_this_engines(capsys, engine, given, own):
    """``--context-length 4096`` to vLLM (SGLang's name for its max-model-len): one line whose fix
    is the engine's own flag with the same value, and that command runs. Before: "leave it out",
    whose command priced the release's default length instead of the one asked."""
    code, _out, err = fit_cli("qwen2.5-7b", "H100", engine, given, "4096", capsys=capsys)
    assert code == 1 and err.count("\n") == 1 and f"flag for it is {own}" in err, err
    argv = err.split("`")[1].split()
    assert f"{own} 4096" in " ".join(argv) and given not in argv, err
    code, out, err = run_fix(err, capsys)
    assert code == 0 and f"{own} 4096" in out, err


def test_where_the_default_graphs_do_not_leave_one_request_fewer_sizes_are_a_fix(capsys):
    """vLLM 0.34.0 sizes its KV cache after capture: at the utilization where the engine
    default's graphs leave less than one 131072-token request of Llama-3.1-8B and the "fewer"
    sizes (up to 64) leave one, --max-cudagraph-capture-size 64 and --enforce-eager are fixes,
    each command runs. Before, fit named only the budget, the length, fp8 and more GPUs."""
    m = cfg("llama-3.1-8b")

    def at(u: float) -> FitResult:
        return fit(FitRequest(m, "H100", "vllm==0.34.0", 1, {"max-model-len": 131072, "gpu-memory-utilization": u}))

    lo, hi = 0.2, 0.9  # a utilization that does not fit, within 1e-3 of one that does
    while hi - lo > 1e-3:
        mid = round((lo + hi) / 2, 4)
        lo, hi = (lo, mid) if at(mid).fits else (mid, hi)
    u, res = lo, at(lo)
    costs = {c.name: c.kv_tokens for c in res.size_costs}
    assert not res.fits and costs["engine default"] < 131072 <= costs["fewer"], costs
    assert "--max-cudagraph-capture-size 64" in res.fixes and "--enforce-eager" in res.fixes, res.fixes
    base = ("--model", str(CONFIGS / "llama-3.1-8b.json"), "--device", "H100", "--engine", "vllm==0.34.0")
    base += ("--max-model-len", "131072", "--gpu-memory-utilization", str(u))
    assert run("fit", *base, capsys=capsys)[0] == 1
    for fix in ("--max-cudagraph-capture-size 64", "--enforce-eager"):
        code, out, err = run("fit", *base, *fix.split(), capsys=capsys)
        assert code == 0, err


def test_a_release_making_its_first_torch_stream_before_its_profile_pays_torch_s_stream_pools(monkeypatch):
    """Where a release's start-up makes the process's first torch stream after its first
    free-memory reading (its rule's ``first_stream = "profile"``: torch makes its stream pools
    then), the non-torch item holds devices.toml's measured ``[first_torch_stream]`` bytes and
    names them; a device without that figure keeps the item as it was, its source saying the
    pools are within the error bar; a rule not read for it (None) adds nothing. vLLM 0.34.0 on
    an H100: its KV cache is smaller by exactly those bytes than with the rule unread."""
    import msgspec

    from capture_plan.planner.fit import estimate, inputs
    from capture_plan.planner.inputs.resources import data

    pools = data("devices.toml")["first_torch_stream"]["sm90"]
    plain = estimate.non_torch(1)
    paid = estimate.non_torch(1, "sm90", True)
    assert paid.bytes - plain.bytes == pools > 0 and paid.error_bytes == plain.error_bytes
    assert "first torch stream" in paid.source and "first torch stream" not in plain.source
    unmeasured = estimate.non_torch(1, "sm80", True)
    assert unmeasured.bytes == plain.bytes and "not measured for sm80: within the error bar" in unmeasured.source
    request = FitRequest(cfg("llama-3.1-8b"), "H100", "vllm==0.34.0", 1, {"max-model-len": 8192})
    paid_fit = fit(request)
    real = inputs.rule_for

    def unread(engine):  # the same release, its rule not read for the first stream
        eng, version, name, rule = real(engine)
        return eng, version, name, msgspec.structs.replace(rule, first_stream=None)

    monkeypatch.setattr(inputs, "rule_for", unread)
    unread_fit = fit(request)
    assert unread_fit.kv_bytes - paid_fit.kv_bytes == pools


#: per release whose rule says ``first_stream = "profile"``: the file and the line that makes its
#: first torch stream, after its first free-memory reading and before its profile
FIRST_STREAMS = {
    "vllm==0.33.0": ("vllm/v1/worker/gpu/model_runner.py", "self.output_copy_stream = torch.cuda.Stream(self.device)"),
    "vllm==0.34.0": ("vllm/v1/worker/gpu/model_runner.py", "self.output_copy_stream = new_d2h_stream(self.device)"),
    "sglang==0.5.23": (
        "sglang/srt/model_executor/model_runner.py",
        "self.init_torch_distributed()\n\n        # Init forward stream for overlap schedule\n"
        "        self.forward_stream = torch.get_device_module(self.device).Stream()",
    ),
}


@pytest.mark.parametrize("release", sorted(FIRST_STREAMS))
def test_the_first_stream_rows_rest_on_the_wheels_code(release):
    """Each release fit says makes its first torch stream before its profile does so in its
    wheel's code (read with zipfile: nothing installed): vLLM's GPUModelRunner.__init__, SGLang's
    ModelRunner.__init__ right after init_torch_distributed (which reads pre_model_load_memory)."""
    from capture_plan.planner.fit.tables import rule_for
    from test_engine_contract import wheel_source

    engine, version = release.split("==")
    assert rule_for(release)[3].first_stream == "profile"
    path, text = FIRST_STREAMS[release]
    assert text in wheel_source(engine, version, path), (release, path)


@pytest.mark.parametrize("release", ["vllm==0.33.0", "vllm==0.34.0"])
def test_the_fused_moe_workspace_is_persistent_where_the_release_splits_its_profile(release):
    """vLLM's workspace manager keeps the fused-MoE workspace after the profiling run's forward.
    0.33.0 and 0.34.0 count what stays allocated after the profile (total_consumed) apart from
    its transient peak, so fit prices the workspace as an item of its own that the KV cache is
    sized around like the engine buffers, and the activation peak leaves it out (before: it was
    in the activation peak, and 0.34.0's after-capture margin, 0.75 x that peak, was too wide).
    0.19.0 deducts the torch peak's increase, which holds it: no item of its own there. A dense
    model has none."""
    m = cfg("qwen3-30b-a3b")
    tokens = 8192  # max_num_batched_tokens on an H100
    # fused_moe.py TritonExperts.workspace_shapes: (M, topk, max(N / 2, K)) + (M, topk, max(N, K)), N = 2 I
    n, k, top = 2 * m.expert_intermediate, m.hidden, m.experts_per_token
    want = m.dtype_bytes * (tokens * top * max(n // 2, k) + tokens * top * max(n, k))
    r = fit(FitRequest(m, "H100", release, 1, {"max-model-len": 8192}))
    names = [i.name for i in r.items]
    assert names.index("engine buffers") + 1 == names.index("MoE workspace") < names.index("activation peak")
    assert _item(r, "MoE workspace").bytes == want and "workspace manager" in _item(r, "MoE workspace").source
    old = fit(FitRequest(m, "H100", "vllm==0.19.0", 1, {"max-model-len": 8192}))
    assert "MoE workspace" not in [i.name for i in old.items]
    # the same profile's peak, counted without the workspace the engine keeps
    assert _item(old, "activation peak").bytes - want >= _item(r, "activation peak").bytes > 0
    assert "an item of its own" in _item(r, "activation peak").source
    assert "MoE workspace" not in [i.name for i in _llama(release).items]


def test_a_shared_expert_is_a_dense_mlp_in_the_moe_layers_peak():
    """An MoE layer's routed experts are priced by the fused-MoE workspace; a shared expert
    (Qwen2-MoE's shared_expert_intermediate_size, DeepSeek's n_shared_experts x
    moe_intermediate_size) is a dense MLP beside them in both engines' layers, whose gate_up and
    activation are live at the MLP phase's peak, sharded by tp (before: left out); the layer's
    peak is the larger of that phase and the attention phase."""
    from capture_plan.planner.fit import estimate
    from capture_plan.planner.fit.tables import sampler_rule

    m = cfg("qwen3-30b-a3b")
    assert m.experts and not m.shared_expert_intermediate
    shared = msgspec.structs.replace(m, shared_expert_intermediate=4096)
    row = sampler_rule("vllm", "0.34.0")
    h, d = m.hidden, m.dtype_bytes
    for tp in (1, 2):
        # one request: the sampler phase is far below the layer phase at 16384 tokens
        base = estimate.activation_peak(m, tp, 16384, 1, row, workspace_held=True).bytes
        more = estimate.activation_peak(shared, tp, 16384, 1, row, workspace_held=True).bytes
        # without one, the attention phase is the peak: residual, the layer's input, qkv, the
        # attention's output, o_proj's (and its reduced copy at tp 2: vLLM's all-reduce is out
        # of place); with one, its MLP phase at down_proj: residual, the layer's input, the
        # normed MLP input, gate_up (Qwen3-MoE's MLP keeps it to its return), the activation,
        # down_proj's output (and its reduced copy); beside the routed phase: those three, the
        # shared output, the routed output, their sum (and its reduced copy)
        reduced = h if tp > 1 else 0
        qkv = (m.heads // tp + 2 * max(1, m.kv_heads // tp)) * m.head_dim
        attention = 3 * h + qkv + m.heads * m.v_head_dim // tp + reduced
        mlp = 3 * h + 3 * 4096 // tp + h + reduced
        assert base == 16384 * d * attention
        assert more == 16384 * d * max(attention, mlp, 6 * h + reduced) > base
