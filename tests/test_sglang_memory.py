"""tests/engines/sglang_memory.py's arithmetic, the SGLang 0.5.23-shaped runner's sizing
(issue 52, item 6), against SGLang's results worked by hand from the wheel's formulas
(sglang/srt/arg_groups/memory_hook.py handle_gpu_memory_settings and reserve_for_graph_mb,
mem_cache/kv_cache_configurator.py _profile_available_bytes and resolve_max_num_reqs,
model_executor/pool_configurator.py DefaultPoolConfigurator). Each expected figure is
written out, not recomputed by the code under test; planner/fit's rule, read from the
same wheel, must give the same settings. No torch: the arithmetic imports none."""

from __future__ import annotations

import pytest

from engines import sglang_memory as sm

H100, H200, A100_40, RTX4090, T4 = 81559, 143771, 40960, 24564, 15360
DECODE_256 = [1, 2, 4, 8, 12, *range(16, 257, 8)]


@pytest.mark.parametrize(
    "gpu_mem, kw, chunk, max_bs, decode, prefill, graph_mb, fraction",
    [
        # 512 + 8192 x 1.5 + 1/8 x 1024 + (256 x 2 + 58 x 8) = 13904; (81559 - 13904) / 81559 = 0.8295
        (H100, {}, 8192, 256, DECODE_256, 58, 976, 0.83),
        # no prefill graphs: 13440; 68119 / 81559 = 0.8352
        (H100, {"prefill_backend": sm.DISABLED}, 8192, 256, DECODE_256, 58, 512, 0.835),
        # the H200's tier is the H100's: (143771 - 13440) / 143771 = 0.9065
        (H200, {"prefill_backend": sm.DISABLED}, 8192, 256, DECODE_256, 58, 512, 0.907),
        # under 60 GiB: 4096 and 32; 50 prefill sizes to 4096; 512 + 6144 + 128 + 64 + 400 = 7248, no floor
        (A100_40, {}, 4096, 32, [1, 2, 4, 8, 12, 16, 24, 32], 50, 464, 0.823),
        # under 35 GiB: 4096 and 48: 7280; 17284 / 24564 = 0.7036
        (RTX4090, {}, 4096, 48, [1, 2, 4, 8, 12, 16, 24, 32, 40, 48], 50, 496, 0.704),
        # under 20 GiB: 2048 and 8; 42 prefill sizes to 2048: 512 + 3072 + 128 + 16 + 336 = 4064
        (T4, {}, 2048, 8, [1, 2, 4, 8], 42, 352, 0.735),
        # tp 4: max_bs 512 (52 sizes); 512 + 12288 + 512 + 1024 + 464 = 14800 -> 0.8185
        (H100, {"tp_size": 4}, 8192, 512, [*DECODE_256, *range(272, 512, 16), 512], 58, 1488, 0.819),
        # a default max_bs above max_running_requests is capped: 64; 13520 -> 0.8342
        (H100, {"max_running_requests": 64}, 8192, 64, DECODE_256[:12], 58, 592, 0.834),
        # MLA: the prefill graphs reserve 1536: 512 + 12288 + 128 + 512 + 1536 = 14976 -> 0.8164
        (H100, {"mla": True}, 8192, 256, DECODE_256, 58, 2048, 0.816),
        # above 60 GiB at least 10240: 512 + 3072 + 128 + 16 = 3728 -> 10240; 71319 / 81559 = 0.8744
        (
            H100,
            {"chunked_prefill_size": 2048, "decode_max_bs": 8, "prefill_backend": sm.DISABLED},
            2048,
            8,
            [1, 2, 4, 8],
            42,
            16,
            0.874,
        ),
        # post-capture sizing: the floor and the parallel slack only, 1536 + 128; 79895 / 81559 = 0.9796
        (H100, {"post_capture_kv_sizing": True}, 8192, 256, DECODE_256, 58, 976, 0.98),
        # given decode sizes: max_bs is their largest
        (H100, {"decode_bs": [1, 8, 96], "prefill_backend": sm.DISABLED}, 8192, 96, [1, 8, 96], 58, 192, 0.839),
    ],
)
def test_the_memory_settings_are_sglangs_for_the_device(
    gpu_mem, kw, chunk, max_bs, decode, prefill, graph_mb, fraction
):
    s = sm.handle_gpu_memory_settings(gpu_mem, context_len=4096, **kw)
    assert (s.chunked_prefill_size, s.decode_max_bs, list(s.decode_bs)) == (chunk, max_bs, decode)
    assert len(s.prefill_bs) == prefill and s.reserve_for_graph_mb == graph_mb
    assert s.mem_fraction_static == fraction


def test_fits_rule_resolves_the_same_settings_from_the_same_reading():
    """planner/fit/sizing.py, separate code from the same wheel: the same tiers, sizes and fraction."""
    from capture_plan.planner.fit import sizing

    for gpu_mem in (H100, H200, A100_40, RTX4090, T4):
        for tp in (1, 4):
            for disabled in (False, True):
                backend = sm.DISABLED if disabled else sm.BREAKABLE
                s = sm.handle_gpu_memory_settings(gpu_mem, context_len=4096, tp_size=tp, prefill_backend=backend)
                assert sizing.sglang_defaults(gpu_mem, tp) == (s.chunked_prefill_size, s.decode_max_bs)
                assert sizing.sglang_decode_sizes(s.decode_max_bs) == list(s.decode_bs)
                prefill = 0 if disabled else len(sizing.sglang_prefill_sizes(s.chunked_prefill_size))
                got = sizing.sglang_mem_fraction(gpu_mem, tp, s.chunked_prefill_size, s.decode_max_bs, prefill, False)
                assert got == s.mem_fraction_static, (gpu_mem, tp, disabled)


def test_the_pool_is_the_free_memory_after_loading_less_the_static_slack():
    """79.0 GiB free before loading, 63.5 after, fraction 0.835: 63.5 - 79.0 x 0.165 = 50.465 GiB;
    a Llama-3-8B-like cell (8 KV heads x (128 + 128) x 32 layers x 2 bytes = 131072 bytes) holds
    413409 tokens of it, 413408 in pages of 16."""
    rest = sm.profile_available_bytes(63.5, 79.0, 0.835)
    assert rest == 54_186_381_148
    cell = sm.cell_size(kv_heads=8, head_dim=128, v_head_dim=128, layers=32, element_size=2)
    assert cell == 131_072
    assert sm.calculate_pool_sizes(rest, cell, 1) == 413_409
    assert sm.calculate_pool_sizes(rest, cell, 16) == 413_408


def test_weights_that_leave_no_pool_are_refused_as_sglang_refuses_them():
    """10 GiB free after loading of 79: 10 - 13.035 <= 0; the minimum fraction 1 - 10/79 = 0.8734,
    suggested 0.874. A pool smaller than one cell has 0 tokens: MemoryPoolConfig refuses it."""
    with pytest.raises(ValueError, match=r"--mem-fraction-static=0.835\. Raise --mem-fraction-static above 0\.874"):
        sm.profile_available_bytes(10.0, 79.0, 0.835)
    with pytest.raises(RuntimeError, match="Not enough memory"):
        sm.calculate_pool_sizes(131_071, 131_072, 1)


@pytest.mark.parametrize(
    "tokens, context, requested, reqs",
    [
        (413_409, 4096, None, 4096),  # int(413409 / 4096 x 512) = 51676: at most 4096
        (10_000, 8192, None, 2048),  # 625: at least 2048
        (3_000, 4096, None, 1500),  # 375 -> 2048, but at most half the tokens
        (413_409, 4096, 100, 100),  # max_running_requests given
        (150, 4096, 100, 75),  # ... and at most half the tokens
    ],
)
def test_the_request_pool_follows_resolve_max_num_reqs(tokens, context, requested, reqs):
    assert sm.resolve_max_num_reqs(tokens, context, requested) == reqs
