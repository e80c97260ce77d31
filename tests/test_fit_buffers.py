"""The V2 model runner's persistent device buffers (planner/data/fit_rules.toml [buffers],
planner/fit/buffers.py): fit's "engine buffers" item counted by hand for each release read, the
KV cache smaller by exactly that item, the releases not read leaving it unknown, and the
runners' stand-ins (tests/engines/vllm_runner.py, vllm_runner_034.py) allocating what the rule
counts. The CPU has no device allocator: the stand-ins' tensors are recorded by a dispatch mode
(every op's outputs, those alive at the end)."""

from __future__ import annotations

import json
import math
import weakref
from pathlib import Path

import pytest

from capture_plan.planner.cli import main
from capture_plan.planner.fit import buffers, vllm as fit_vllm
from capture_plan.planner.fit.tables import buffer_rule, buffer_rules, devices, releases
from capture_plan.schemas.fit import FitItem

ROOT = Path(__file__).resolve().parent.parent
LLAMA = str(ROOT / "planner" / "data" / "configs" / "llama-3.1-8b.json")
#: a small deployment of Llama-3.1-8B (vocabulary 128,256: cdiv(., 32) = 4008 words a row)
SMALL = {"max-num-seqs": 16, "max-num-batched-tokens": 64, "max-model-len": 256, "enforce-eager": True}
V, WORDS, SEQS, TOKENS = 128256, 4008, 16, 64


def _fit(engine: str, capsys, flags: dict = SMALL) -> dict:
    args = [f"--{k}" if v is True else f"--{k} {v}" for k, v in flags.items()]
    code = main(["fit", "--model", LLAMA, "--device", "H100", "--engine", engine, *" ".join(args).split(), "--json"])
    out = capsys.readouterr()
    assert code == 0, out.err
    return json.loads(out.out)


def _item(res: dict, name: str) -> dict:
    return next(i for i in res["items"] if i["name"] == name)


def by_hand(release: str) -> int:
    """The small deployment's buffers as the V2 runner's code makes them, each named for its class
    (0.34.0: the block tables too, made before its KV cache is measured)."""
    request_state = SEQS * 4 + SEQS * 4 + SEQS * 8 + SEQS * 4  # total_len, computed, last sampled, prefill lookahead
    input_buffers = TOKENS * (4 + 8 + 1) + (SEQS + 1) * 4 + 2 * SEQS * 4  # ids, positions, padding; qsl; seq lens
    penalties = SEQS * WORDS * 4 + SEQS * V * 4  # prompt_bin_mask, output_bin_counts
    logit_bias = 3 * SEQS * 1024 * 4 + SEQS * 128 * 4  # allowed ids, bias ids, bias; stop ids
    bad_words = SEQS * 1024 * 4 + SEQS * 129 * 4
    logprob_ids = SEQS * 128 * 4
    structured = SEQS * 4 + SEQS * WORDS * 4  # logits indices, grammar bitmask
    # the Triton top-k/top-p scratch: min(next_power_of_2(min(132 SMs, 16 rows)), 132) rows, and two
    # tables; 0.33.0's stock install runs FlashInfer's sampler instead: its 1 MiB row-states cache
    sampler = (1 << 20) if release == "0.33.0" else 16 * V * 4 + 2 * 200 * 4
    b = request_state + input_buffers + penalties + logit_bias + bad_words + logprob_ids + structured + sampler
    if release == "0.34.0":  # one KV group: 256 / 16 = 16 blocks (a multiple of 128 / 16 = 8) a row, twice; slots
        b += 2 * SEQS * 16 * 4 + TOKENS * 8
    return b


@pytest.mark.parametrize("release", ["0.33.0", "0.34.0"])
def test_the_engine_buffers_item_is_the_runners_tensors_counted_by_hand(release, capsys):
    """vLLM 0.33.0 and 0.34.0: the request state and input buffers (GPUModelRunner.__init__), the
    sampler's per-request state and the structured outputs' bitmask (load_model), the Triton
    top-k/top-p scratch the profile keeps (0.33.0, whose stock install runs FlashInfer's sampler:
    its 1 MiB row-state cache instead) and, in 0.34.0 only, the block tables its KV cache's
    measure follows; its error bar holds the other sampler branch (fails before: no such item)."""
    res = _fit(f"vllm=={release}", capsys)
    item = _item(res, "engine buffers")
    assert item["bytes"] == by_hand(release) and item["status"] == "exact"
    assert item["error_bytes"] >= abs((1 << 20) - (16 * V * 4 + 1600))
    assert "[buffers.vllm-0-33]" in item["source"] and "PenaltiesState.output_bin_counts" in item["source"]
    names = [i["name"] for i in res["items"]]
    assert names.index("non-torch memory") + 1 == names.index("engine buffers") < names.index("activation peak")


@pytest.mark.parametrize("release", ["0.33.0", "0.34.0"])
@pytest.mark.parametrize("flags", [SMALL, {}], ids=["small", "defaults"])
def test_fits_kv_cache_is_smaller_by_exactly_the_item(release, flags, monkeypatch, capsys):
    """The KV bytes of `planner fit --json` with the item against the same fit with it priced at
    0: the release's rule takes it whole (0.33.0: from the budget, as total_consumed; 0.34.0: in
    non_kv_used, on both sides of measure_kv_cache_bytes' min) (fails before: no item)."""
    engine = f"vllm=={release}"
    res = _fit(engine, capsys, flags)
    engine_buffers = fit_vllm.engine_buffers
    monkeypatch.setattr(
        fit_vllm,
        "engine_buffers",
        lambda *a, **kw: FitItem("engine buffers", 0, 0, "exact", engine_buffers(*a, **kw).source),
    )
    without = _fit(engine, capsys, flags)
    moved = _item(res, "engine buffers")["bytes"]
    assert moved > 0 and res["kv_bytes"] == without["kv_bytes"] - moved
    assert (
        _item(res, "KV cache")["error_bytes"]
        == _item(without, "KV cache")["error_bytes"] + _item(res, "engine buffers")["error_bytes"]
    )
    if not flags:  # the defaults on an H100: 1024 sequences, 8192 tokens, the 128K context
        # (0.33.0 without the Triton scratch: its stock install runs FlashInfer's sampler)
        assert (550 if release == "0.33.0" else 600) << 20 < moved < 700 << 20


def test_a_release_not_read_for_them_leaves_the_item_unknown(capsys):
    """The V1 runner's releases (before 0.33.0) were not read for their buffers: the item is
    unknown, and their KV figures are as they were (the published logs' gaps do not move)
    (fails before: no such item)."""
    read = {v for r in buffer_rules().values() for v in r.releases}
    assert read == {"0.33.0", "0.34.0"} and buffer_rule("vllm", "0.34.0")[0] == "vllm-0-33"
    for engine in [r for r in releases() if r.startswith("vllm==")]:
        version = engine.split("==")[1]
        if version in read:
            continue
        item = _item(_fit(engine, capsys, {"max-model-len": 8192}), "engine buffers")
        assert item["bytes"] is None and item["status"] == "unknown", engine
        assert "not read" in item["source"] and "0.33.0, 0.34.0" in item["source"]
    res = _fit("sglang==0.5.23", capsys, {"context-length": 8192})
    assert "engine buffers" not in [i["name"] for i in res["items"]]  # SGLang: not read here


def test_every_device_has_its_sm_count_and_a_source():
    """The Triton top-k/top-p scratch is SMs x vocab rows: every device fit knows names its SMs."""
    for name, dev in devices().items():
        assert dev.sms > 0 and dev.sms_source, name
    assert devices()["NVIDIA H100 80GB HBM3"].sms == 132


def test_each_tensor_names_the_releases_file_and_is_made_at_a_stage_of_its_start_up():
    (rule,) = buffer_rules().values()
    names = [t.name for t in rule.tensors]
    assert len(names) == len(set(names))
    for t in rule.tensors:
        assert ".py" in t.source and t.at in ("init", "load", "profile", "kv-init"), t.name
    stages = [t.at for t in rule.tensors]
    assert stages == sorted(stages, key=("init", "load", "profile", "kv-init").index)  # the start-up's order


def test_under_ngram_the_token_history_is_on_the_device():
    """RequestState.all_token_ids is pinned host memory (UVA) unless the speculator wants a dense
    history (n-gram): max_num_seqs x max_model_len int32 then."""
    (rule,) = buffer_rules().values()
    dims = {"max_num_seqs": 4, "max_model_len": 1000}
    dense = [t for t in buffers.counted(rule, ("init",), "ngram") if t.methods]
    assert [buffers.tensor_bytes(t, dims) for t in dense] == [4 * 1000 * 4]
    assert not [t for t in buffers.counted(rule, ("init",), "eagle") if t.methods]


# -- the runners' stand-ins -------------------------------------------------------------------------


def _recorder():
    torch = pytest.importorskip("torch")
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class Recorder(TorchDispatchMode):
        """Every op's outputs under it, weakly; :meth:`live`: (elements, dtype) of each storage
        made under it that a tensor still holds."""

        def __init__(self):
            super().__init__()
            self.refs: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.refs += [weakref.ref(t) for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
            return out

        def live(self) -> list[tuple[int, str]]:
            seen: dict[int, tuple[int, str]] = {}
            for ref in self.refs:
                t = ref()
                if t is not None and t.untyped_storage().nbytes():
                    s = t.untyped_storage()
                    seen.setdefault(s.data_ptr(), (s.nbytes() // t.element_size(), str(t.dtype).split(".")[1]))
            return sorted(seen.values())

    return torch, Recorder


@pytest.mark.parametrize("release", ["0.34.0", "0.33.0"])
def test_the_runners_stand_ins_allocate_what_the_rule_counts(release, fake, tmp_path):
    """The 0.34.0 runner as the bench loads it (0.33.0-shaped with 0.33.0's sampler), on the CPU:
    what its start-up keeps (GPUModelRunner.__init__'s request state and input buffers, the
    sampler's state and the structured outputs' buffers, the Triton caches after the dummy sampler
    run, the block tables at initialize_kv_cache) is what fit's rule counts for the release at the
    same settings, tensor by tensor (elements and dtype) (fails before: the runner made none of
    them, and took no vocabulary)."""
    torch, Recorder = _recorder()
    from engines import adoption, plugged, vllm_runner
    from engines.toy import ToyModel

    module = adoption.before_module(Path(vllm_runner.__file__), tmp_path, f"vllm_buffers_{tmp_path.name}")
    for path in plugged.later("vllm", "0.34.0"):
        exec(compile(path.read_text(), str(path), "exec"), vars(module))
    module.reset_globals()
    seqs, tokens, vocab, mml, block, sms = 6, 24, 3000, 100, 16, 4
    model = ToyModel({"decode": 1}, max_tokens=tokens, fake=fake)
    head = torch.randn(model.hidden, vocab)
    hidden = torch.randn(seqs, model.hidden)
    sampler = None if release == "0.34.0" else module.Sampler.__base__
    with Recorder() as rec:
        runner = module.GPUModelRunner(
            model,
            [1, 2, 4],
            max_num_tokens=tokens,
            max_num_reqs=seqs,
            vocab_size=vocab,
            max_model_len=mml,
            sampler_cls=sampler,
        )
        runner.sampler.num_sm = sms
        runner.compute_logits = lambda h: h @ head
        runner._dummy_sampler_run(hidden)
        if release == "0.34.0":  # the extensible cache's initialize_kv_cache, before the measure
            runner.initialize_kv_cache([block])
        kept = rec.live()
    _, rule = buffer_rule("vllm", release)
    dims = {
        "max_num_seqs": seqs,
        "max_num_seqs_plus_one": seqs + 1,
        "max_num_batched_tokens": tokens,
        "max_model_len": mml,
        "vocab": vocab,
        "vocab_words": math.ceil(vocab / 32),
        "speculative_tokens": 0,
        "decode_query_len": 1,
        "topk_programs": 4,  # min(next_power_of_2(min(4 SMs, 6 rows)), 4)
        "kv_groups": 1,
        "block_table_width": 8,  # cdiv(100, 16) = 7 blocks, to a multiple of 128 / 16 = 8
    }
    stages = ("init", "load", "profile", "kv-init") if release == "0.34.0" else ("init", "load", "profile")
    want = sorted(
        (buffers.tensor_bytes(t, dims) // buffers._DTYPE_BYTES[t.dtype], t.dtype)
        for t in buffers.counted(rule, stages, "")
        if buffers.tensor_bytes(t, dims)
    )
    assert kept == want


@pytest.mark.parametrize("release", ["0.33.0", "0.34.0"])
def test_the_samplers_kept_scratch_is_not_in_the_forwards_headroom(release, capsys):
    """memory_profiling's transient headroom is torch's peak less what stays allocated: the dummy
    sampler's scratch (0.34.0's Triton top-k/top-p buffer and tables, 0.33.0's FlashInfer row
    states) is made after the forward's peak and kept, so where the forward's peak is the
    larger (8192 tokens, 16 requests), the activation item is that peak less the scratch
    (before: the whole peak; the runner measured it 16 MiB lower on a 32,000-word vocabulary)."""
    from capture_plan.planner.fit import estimate
    from capture_plan.planner.fit.model import load_model

    flags = {**SMALL, "max-num-batched-tokens": 8192}
    got = _item(_fit(f"vllm=={release}", capsys, flags), "activation peak")["bytes"]
    m = load_model(LLAMA)
    layer = 8192 * estimate.activation_per_token(m, 1)
    sampler = (1 << 20) if release == "0.33.0" else 16 * V * 4 + 2 * 200 * 4
    assert got == layer - sampler
