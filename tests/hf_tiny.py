"""Small transformers configs of each architecture the HF adapter is tested
with (random weights, built from the config: no download), shared by the CPU
and the GPU adapter tests, which pick the sizes."""

from __future__ import annotations

#: what each kind exercises in the adapter
KINDS = {
    "llama": "dense",
    "mixtral": "MoE (top-2 of 4 experts)",
    "qwen2_moe": "MoE with a shared expert",
    "qwen3_moe": "MoE (its config says num_local_experts since transformers 5.17)",
    "deepseek_v3": "MLA (a compressed latent cache); a dense layer, then group-limited routing and a shared expert",
    "gpt_oss": "MoE with biases, attention sinks (eager attention), a sliding layer then a full one",
    "glm4_moe": "a dense layer, then MoE with a shared expert",
    "mistral": "sliding-window attention on every layer",
    "gemma2": "alternating sliding and full layers, soft-capping (eager attention)",
}

#: kinds whose attention transformers runs only eagerly (sinks, soft-capping)
EAGER_ATTENTION = {"gemma2", "gpt_oss"}


def config(kind: str, common: dict, *, head_dim: int, expert: int, window: int):
    """``kind``'s config: ``common`` dims (hidden_size, heads, ...), ``head_dim``
    where the type takes one, experts ``expert`` wide, sliding windows of
    ``window`` tokens; MLA ranks scale with ``head_dim``."""
    import transformers

    moe = dict(num_experts_per_tok=2, moe_intermediate_size=expert)
    if kind == "llama":
        return transformers.LlamaConfig(**common)
    if kind == "mixtral":
        return transformers.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2)
    if kind == "qwen2_moe":
        return transformers.Qwen2MoeConfig(**common, **moe, num_experts=8, shared_expert_intermediate_size=2 * expert)
    if kind == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**common, **moe, num_experts=8)
    if kind == "deepseek_v3":  # MLA attends with every head
        return transformers.DeepseekV3Config(
            **{**common, "num_key_value_heads": common["num_attention_heads"]},
            **moe,
            kv_lora_rank=head_dim,
            q_lora_rank=head_dim + head_dim // 2,
            qk_nope_head_dim=head_dim,
            qk_rope_head_dim=head_dim // 2,
            v_head_dim=head_dim // 2 + head_dim // 4,
            n_routed_experts=8,
            n_shared_experts=1,
            n_group=2,
            topk_group=1,
            first_k_dense_replace=1,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )
    if kind == "gpt_oss":
        return transformers.GptOssConfig(
            **common, head_dim=head_dim, num_local_experts=4, num_experts_per_tok=2, sliding_window=window
        )
    if kind == "glm4_moe":
        return transformers.Glm4MoeConfig(
            **common, **moe, n_routed_experts=8, n_shared_experts=1, first_k_dense_replace=1
        )
    if kind == "mistral":
        return transformers.MistralConfig(**common, sliding_window=window)
    if kind == "gemma2":
        return transformers.Gemma2Config(**common, head_dim=head_dim, sliding_window=window)
    raise AssertionError(kind)


#: the CPU adapter tests' dimensions (tests/test_adapters.py, tests/test_adapters_fa3.py)
CPU_DIMS = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=101,
    max_position_embeddings=256,
)


def cpu_model(kind: str, window: int = 64, **kw):
    """``kind``'s model at :data:`CPU_DIMS` in float32, random weights seeded 0 (two calls give
    the same weights), with transformers' attention (eager where :data:`EAGER_ATTENTION`)."""
    import torch
    import transformers

    cfg = config(kind, CPU_DIMS, head_dim=16, expert=32, window=window)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(
        cfg, attn_implementation="eager" if kind in EAGER_ATTENTION else "sdpa", **kw
    ).to(torch.float32)


def decode_last(target, model, n: int = 12, seed: int = 4):
    """Two random sequences of ``n`` tokens decoded token by token through ``target`` (an
    ``HFTarget`` of batch 2, every earlier token seen), and ``model``'s full-sequence forward
    over them: ``(the target's last logits, the model's)``."""
    import torch

    ids = torch.randint(0, target.vocab, (2, n), generator=torch.Generator().manual_seed(seed))
    buf = target._buffers[1]
    for p in range(n):
        buf.ids[:2, 0] = ids[:, p]
        target._place(buf, 2, torch.tensor(p), torch.full((2,), p))
        got = target.run("decode", 2, None)
    with torch.no_grad():
        want = model(input_ids=ids, use_cache=False).logits[:, -1]
    return got, want
