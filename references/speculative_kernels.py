"""The speculative reference's KV-metadata kernels, twice: plain torch (the
specification, used on the CPU) and Triton (on CUDA; the engine's way, and the only
place :mod:`capture_plan.references.speculative`'s planted bugs live: unmasked stores
with flat index arithmetic). A GPU test checks that both agree.
"""

from __future__ import annotations

import torch


# -- torch specification of the metadata kernels ------------------------------
def _torch_kv_rows(req_to_token, slots, lens, step, kv, topk, width):
    rows = slots.numel() * topk
    table = kv[: rows * width].view(rows, width)
    pos = lens.long().repeat_interleave(topk)[:, None] + torch.arange(step + 1, device=kv.device)[None, :]
    table[:, : step + 1] = req_to_token[slots.long().repeat_interleave(topk)[:, None], pos]
    return (table[:, 0] // req_to_token.shape[1]).to(torch.int32)


def _torch_page_scatter(locs, table, stride, page):
    rows, steps = locs.shape
    t = table.view(rows, stride)
    t[:, :steps] = (locs // page).to(torch.int32)
    return t[:, :steps]


# -- Triton: the engine's kernels, where the planted bugs live ----------------
def _triton_kernels():
    # triton comes with CUDA builds of torch; where it is missing (a CPU torch) pyright cannot
    # resolve it, nor see that @triton.jit makes the kernels below subscriptable (kernel[grid])
    try:
        import triton  # pyright: ignore[reportMissingImports]
        import triton.language as tl  # pyright: ignore[reportMissingImports]
    except ImportError:
        return None

    @triton.jit
    def kv_indices_kernel(req_to_token, slots, lens, kv, topk, step, width, ctx, BLOCK: tl.constexpr):
        r = tl.program_id(0)
        req = r // topk
        slot = tl.load(slots + req).to(tl.int64)
        j = tl.arange(0, BLOCK)
        m = j <= step  # masked by the branch's length, never by the buffer's size
        v = tl.load(req_to_token + slot * ctx + tl.load(lens + req) + j, mask=m)
        tl.store(kv + r.to(tl.int64) * width + j, v, mask=m)

    @triton.jit
    def row_of_kernel(kv, out, width, ctx):
        r = tl.program_id(0)
        first = tl.load(kv + r.to(tl.int64) * width)
        tl.store(out + r, first // ctx)

    @triton.jit
    def page_scatter_kernel(locs, table, steps, stride, page, BLOCK: tl.constexpr):
        r = tl.program_id(0)
        s = tl.arange(0, BLOCK)
        m = s < steps
        loc = tl.load(locs + r * steps + s, mask=m)
        # flat index: row r's step s at r * stride + s
        tl.store(table + r * stride + s, (loc // page).to(tl.int32), mask=m)

    @triton.jit
    def page_read_kernel(table, out, steps, cols, BLOCK: tl.constexpr):
        r = tl.program_id(0)
        s = tl.arange(0, BLOCK)
        m = s < steps
        tl.store(out + r * steps + s, tl.load(table + r * cols + s, mask=m), mask=m)

    @triton.jit
    def record_accept_kernel(slots, accept, table, stride, UNSIGNED: tl.constexpr):
        r = tl.program_id(0)
        slot = tl.load(slots + r)
        if UNSIGNED:
            slot = slot.to(tl.uint32, bitcast=True)
        tl.store(table + slot.to(tl.int64) * stride, tl.load(accept + r))

    class Kernels:
        @staticmethod
        def kv_rows(req_to_token, slots, lens, step, kv, topk, width, ctx):
            rows = slots.numel() * topk
            out = torch.empty(rows, dtype=torch.int32, device=kv.device)
            kv_indices_kernel[(rows,)](  # pyright: ignore[reportIndexIssue]
                req_to_token, slots, lens, kv, topk, step, width, ctx, BLOCK=triton.next_power_of_2(step + 1)
            )
            row_of_kernel[(rows,)](kv, out, width, ctx)  # pyright: ignore[reportIndexIssue]
            return out

        @staticmethod
        def page_scatter(locs, table, stride, page):
            rows, steps = locs.shape
            block = triton.next_power_of_2(steps)
            locs = locs.contiguous()
            # flat indices with the full row stride, whatever size ``table`` was given
            page_scatter_kernel[(rows,)](locs, table, steps, stride, page, BLOCK=block)  # pyright: ignore[reportIndexIssue]
            pages = torch.empty(rows, steps, dtype=torch.int32, device=locs.device)
            page_read_kernel[(rows,)](table, pages, steps, stride, BLOCK=block)  # pyright: ignore[reportIndexIssue]
            return pages

        @staticmethod
        def record_accept(slots, accept, table, wild):
            record_accept_kernel[(slots.numel(),)](slots, accept, table, table.stride(0), UNSIGNED=wild)  # pyright: ignore[reportIndexIssue]

    return Kernels()
