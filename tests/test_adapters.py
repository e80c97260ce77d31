"""The transformers adapter's eager path on CPU, with tiny random models built from configs."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import hf_tiny  # noqa: E402
from capture_plan.adapters.hf import DETERMINISTIC_SDPA, HFTarget  # noqa: E402

TINY = hf_tiny.CPU_DIMS
_model = hf_tiny.cpu_model


KINDS = list(hf_tiny.KINDS)


@pytest.mark.parametrize("kind", KINDS)
def test_run_is_repeatable_and_rows_are_independent(kind):
    target = HFTarget(_model(kind), max_bs=4, max_seqlen=32)
    gen = torch.Generator().manual_seed(1)
    target.prepare("decode", 4, 4, gen)
    a = target.run("decode", 4, None).clone()
    assert a.shape == (4, 101) and torch.isfinite(a).all()
    # the write position is reset every run: a second run sees the same cache
    assert torch.equal(target.run("decode", 4, None), a)
    # batch 2 uses rows [:2] of the same cache and buffers
    assert torch.allclose(target.run("decode", 2, None), a[:2], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("kind", KINDS)
def test_step_with_no_history_equals_the_model_without_cache(kind):
    model = _model(kind)
    target = HFTarget(model, max_bs=4, max_seqlen=16)
    gen = torch.Generator().manual_seed(2)
    target.prepare("decode", 3, 3, gen)
    buf = target._buffers[1]
    pos = int(target.position)
    buf.mask[:3] = torch.finfo(buf.mask.dtype).min
    buf.mask[:3, ..., pos] = 0
    got = target.run("decode", 3, None)
    with torch.no_grad():
        want = model(input_ids=buf.ids[:3], position_ids=buf.positions[:3], use_cache=False).logits[:, -1]
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-4)
    # the new keys landed in the shared static cache at the prepared slot, rows 0..2 only
    k = target.cache.layers[0].keys
    assert k[:3, :, pos].abs().sum() > 0 and k[3:].abs().sum() == 0


def test_multi_token_phase_and_history_mask():
    target = HFTarget(_model("llama"), max_bs=2, max_seqlen=16, tokens={"decode": 1, "target_verify": 4})
    gen = torch.Generator().manual_seed(3)
    target.prepare("target_verify", 2, 2, gen)
    out = target.run("target_verify", 2, None)
    assert out.shape == (8, 101)
    m = target._buffers[4].mask[0, 0]
    pos = int(target.position)
    # token i sees the new tokens up to itself and none after
    for i in range(4):
        assert (m[i, pos : pos + i + 1] == 0).all()
        assert (m[i, pos + i + 1 :] < 0).all()


@pytest.mark.parametrize("kind", ["mistral", "gpt_oss", "gemma2"])  # every layer sliding; mixed; mixed
def test_a_window_narrower_than_the_cache_attends_as_transformers_does(kind):
    """Sliding layers keep every slot, and the window is the mask's (transformers'
    own ring of window slots rolls on a host-side branch, which a graph would
    freeze): decoding a sequence token by token ends on the logits of
    transformers' full-sequence forward with its sliding masks."""
    window, n = 4, 12
    model = _model(kind, window=window)
    target = HFTarget(model, max_bs=2, max_seqlen=16)
    assert target.window == window and all(layer.keys.shape[2] == 16 for layer in target.cache.layers)
    got, want = hf_tiny.decode_last(target, model, n)
    _, unwindowed = hf_tiny.decode_last(target, _model(kind, window=64), n)  # same weights, same ids
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-4)
    assert not torch.allclose(want, unwindowed, atol=1e-3)  # the window changes this sequence's result


def test_chunked_attention_narrower_than_the_cache_is_refused():
    cfg = transformers.Llama4TextConfig(
        **TINY,
        head_dim=16,
        num_local_experts=2,
        intermediate_size_mlp=128,
        attention_chunk_size=8,
        layer_types=["chunked_attention", "full_attention"],
    )
    with pytest.raises(ValueError, match="layer 0 is chunked_attention over 8 tokens < max_seqlen 16"):
        HFTarget(transformers.AutoModelForCausalLM.from_config(cfg), max_bs=2, max_seqlen=16)


def test_hf_target_is_a_capture_target():
    from capture_plan.executor.target import CaptureTarget

    assert isinstance(HFTarget(_model("llama"), max_bs=2, max_seqlen=8), CaptureTarget)


def test_the_model_key_names_the_model_and_changes_with_what_its_memory_depends_on():
    """A start-up calibration is reused only for the same key: the same model built again
    has it; another config, dtype or buffer size does not."""
    key = HFTarget(_model("llama"), max_bs=2, max_seqlen=8).model_key()
    assert key == HFTarget(_model("llama"), max_bs=2, max_seqlen=8).model_key()
    assert key.startswith("LlamaForCausalLM torch.float32 ")
    assert key != HFTarget(_model("llama").to(torch.bfloat16), max_bs=2, max_seqlen=8).model_key()
    assert key != HFTarget(_model("llama"), max_bs=4, max_seqlen=8).model_key()
    assert key != HFTarget(_model("mistral"), max_bs=2, max_seqlen=8).model_key()
    moved = _model("llama")
    moved.config._name_or_path = "/tmp/another/checkout"  # loaded from elsewhere: the same model
    assert HFTarget(moved, max_bs=2, max_seqlen=8).model_key() == key


def _sdpa_flags():
    b = torch.backends.cuda
    return {
        "CUDNN_ATTENTION": b.cudnn_sdp_enabled(),
        "FLASH_ATTENTION": b.flash_sdp_enabled(),
        "EFFICIENT_ATTENTION": b.mem_efficient_sdp_enabled(),
        "MATH": b.math_sdp_enabled(),
    }


@pytest.mark.parametrize("backends", [None, ("EFFICIENT_ATTENTION", "MATH")], ids=["default", "explicit"])
def test_attention_kernels_are_pinned_while_the_model_runs(monkeypatch, backends):
    """PyTorch's dispatcher prefers cuDNN attention for the masked decode SDPA
    on an H200, a kernel it refuses in deterministic mode; the adapter allows
    flash / efficient / math for the call and restores the global flags after."""
    from capture_plan.adapters.hf import DETERMINISTIC_SDPA

    seen = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append(_sdpa_flags())
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    kw = {} if backends is None else {"sdpa_backends": backends}
    target = HFTarget(_model("llama"), max_bs=2, max_seqlen=8, **kw)
    before = _sdpa_flags()
    seen.clear()
    target.run("decode", 2, None)
    assert len(seen) == 2  # one call per layer
    allowed = set(backends or DETERMINISTIC_SDPA)
    assert all(flags == {k: k in allowed for k in flags} for flags in seen), seen
    assert _sdpa_flags() == before
    target.sdpa_backends = None  # PyTorch's own dispatch: the global flags as they are
    seen.clear()
    target.run("decode", 2, None)
    assert seen and all(flags == before for flags in seen)


@pytest.mark.parametrize("backends", [("CUDNN",), (), []], ids=["unknown", "empty-tuple", "empty-list"])
def test_unknown_or_no_attention_kernel_is_refused(backends):
    with pytest.raises(ValueError, match="sdpa_backends"):
        HFTarget(_model("llama"), max_bs=2, max_seqlen=8, sdpa_backends=backends)


def test_overlapping_runs_keep_the_pin_until_the_last_one_ends():
    """A background capture's run and the serving thread's eager fallback can
    overlap: the first to finish must not restore PyTorch's flags under the
    other (a per-call save and restore did)."""
    target = HFTarget(_model("llama"), max_bs=2, max_seqlen=8)
    before = _sdpa_flags()
    pinned = {k: k in DETERMINISTIC_SDPA for k in before}
    a, b = target._attention(), target._attention()
    a.__enter__()
    b.__enter__()
    a.__exit__(None, None, None)  # the first run ends while the second still runs
    assert _sdpa_flags() == pinned
    b.__exit__(None, None, None)
    assert _sdpa_flags() == before


class _OpLog(torch.utils._python_dispatch.TorchDispatchMode):
    """Every aten op the step dispatches: its name, its non-tensor arguments, and
    for each tensor argument shape, strides, offset, dtype and which static
    buffer it lives in (or ``tmp``: memory allocated in the step)."""

    def __init__(self, static: dict):
        super().__init__()
        self.static, self.ops = static, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat, _ = torch.utils._pytree.tree_flatten((args, kwargs))
        self.ops.append(
            (
                str(func),
                tuple(
                    (
                        tuple(a.shape),
                        a.stride(),
                        a.storage_offset(),
                        a.dtype,
                        self.static.get(a.untyped_storage().data_ptr(), "tmp"),
                    )
                    if isinstance(a, torch.Tensor)
                    else repr(a)
                    for a in flat
                ),
            )
        )
        return func(*args, **kwargs)


def _static_buffers(target) -> dict:
    named = [(f"param {n}", t) for n, t in target.model.named_parameters()]
    named += [(f"buffer {n}", t) for n, t in target.model.named_buffers()]
    for i, layer in enumerate(target.cache.layers):
        named += [(f"keys {i}", layer.keys), (f"values {i}", layer.values)]
    named += [("counters", target._counters), ("position", target.position)]
    for t, buf in target._buffers.items():
        named += [(f"ids {t}", buf.ids), (f"positions {t}", buf.positions), (f"mask {t}", buf.mask)]
        if buf.window_mask is not None:
            named.append((f"window mask {t}", buf.window_mask))
    return {x.untyped_storage().data_ptr(): n for n, x in named}


@pytest.mark.parametrize("kind,window", [(k, 64) for k in KINDS] + [("mistral", 8), ("gpt_oss", 8)])
def test_step_is_one_program_for_any_inputs_eager_or_captured(kind, window, monkeypatch):
    """A replay re-launches the kernels recorded at capture with the arguments
    they had then; an eager run launches what the Python code decides now. They
    compute the same thing only if the step is one program: the same ops with
    the same non-tensor arguments on the same buffers, whatever the inputs and
    whether or not a capture is under way (transformers checks
    torch.cuda.is_current_stream_capturing() in places), and no tensor value
    read on the host (.item(), which a capture would freeze)."""
    target = HFTarget(_model(kind, window=window).to(torch.bfloat16), max_bs=8, max_seqlen=32)
    target.run("decode", 6, None)  # the cache view of batch 6 is made once, on first use
    static = _static_buffers(target)
    logs = []
    for seed, capturing in ((1, False), (2, False), (3, True)):
        target.prepare("decode", 6, 6, torch.Generator().manual_seed(seed))
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda c=capturing: c)
        with _OpLog(static) as log:
            target.run("decode", 6, None)
        logs.append(log.ops)
    assert not [op for op in logs[0] if "_local_scalar_dense" in op[0]]
    assert any(op[0].startswith("aten.index_copy") for op in logs[0])  # the cache write is in the program
    assert logs[0] == logs[1], next((a, b) for a, b in zip(logs[0], logs[1]) if a != b)
    assert logs[0] == logs[2], next((a, b) for a, b in zip(logs[0], logs[2]) if a != b)


def _alive_after(fn, tmp_path) -> tuple[dict, object]:
    """(address -> bytes of the allocations ``fn`` made and left alive, its result),
    from the profiler's memory events."""
    import json

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    prof.export_chrome_trace(str(tmp_path / "trace.json"))
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    alive: dict = {}
    for e in sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: e["ts"]):
        addr, nbytes = e["args"]["Addr"], e["args"]["Bytes"]
        if nbytes > 0:
            alive[addr] = nbytes
        else:
            alive.pop(addr, None)
    return alive, result


@pytest.mark.parametrize("kind", KINDS)
def test_a_step_leaves_nothing_alive_but_its_output(kind, tmp_path):
    """In a shared pool only what a step leaves alive can hold memory from one
    graph's capture to the next: the adapter and the model keep no buffer made
    lazily, no routing tensor and no per-size cache (a size never run before
    only gets a cache view, which owns no memory)."""
    target = HFTarget(_model(kind), max_bs=8, max_seqlen=32)
    target.run("decode", 8, None)
    for bs in (8, 3):
        alive, out = _alive_after(lambda bs=bs: target.run("decode", bs, None), tmp_path)
        assert alive == {out.untyped_storage().data_ptr(): out.untyped_storage().nbytes()}, (bs, alive)


def test_mla_cache_has_the_shapes_the_model_writes():
    """DeepSeek-V3's MLA caches its compressed latent, one head: as "keys" the
    kv_lora_rank part, as "values" the qk_rope_head_dim part (transformers
    expands them to per-head keys and values after the cache). A cache made
    from the config's heads and head_dim made the first step fail in
    index_copy_; the adapter now takes each layer's shapes from the model."""
    model = _model("deepseek_v3")
    cfg = model.config
    assert cfg.kv_lora_rank != cfg.qk_rope_head_dim and cfg.v_head_dim != cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    target = HFTarget(model, max_bs=4, max_seqlen=16)
    for layer in target.cache.layers:
        assert layer.keys.shape == (4, 1, 16, cfg.kv_lora_rank)
        assert layer.values.shape == (4, 1, 16, cfg.qk_rope_head_dim)


def test_run_uses_the_cache_argument_this_transformers_names():
    """transformers 5.24 renamed forward's ``past_key_values`` to ``cache`` (the old
    name warns); 5.17 knows only ``past_key_values``. No deprecation warning either way."""
    import warnings

    target = HFTarget(_model("llama"), max_bs=2, max_seqlen=8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        target.run("decode", 2, None)
    params = __import__("inspect").signature(target.model.forward).parameters
    assert target._cache_kwarg in params


@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
def test_moe_experts_route_on_the_device(impl, monkeypatch):
    """Both device-side experts implementations of transformers are one program
    for any routing (the same ops on the same buffers), eager or captured."""
    target = HFTarget(_model("qwen3_moe", experts_implementation=impl).to(torch.bfloat16), max_bs=8, max_seqlen=32)
    assert target.model.config._experts_implementation == impl
    target.run("decode", 6, None)
    static = _static_buffers(target)
    logs = []
    for seed in (1, 2):
        target.prepare("decode", 6, 6, torch.Generator().manual_seed(seed))
        with _OpLog(static) as log:
            target.run("decode", 6, None)
        logs.append(log.ops)
    assert logs[0] == logs[1]


def test_experts_that_route_on_the_host_are_refused():
    with pytest.raises(ValueError, match=r"experts_implementation 'eager' routes tokens on the host"):
        HFTarget(_model("mixtral", experts_implementation="eager"), max_bs=2, max_seqlen=8)


def test_linear_attention_layers_are_refused():
    """Qwen3-Next's Gated DeltaNet layers keep a state that transformers allocates
    at first use, which would land in the first capture's pool."""
    cfg = transformers.Qwen3NextConfig(
        **TINY,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        layer_types=["linear_attention", "full_attention"],
    )
    with pytest.raises(ValueError, match=r"cache layer 0 is a .*supports attention layers with a key/value cache"):
        HFTarget(transformers.AutoModelForCausalLM.from_config(cfg), max_bs=2, max_seqlen=8)
