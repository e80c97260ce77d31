"""A private pool of PyTorch's CUDA caching allocator, simulated on the CPU.

The rules below are those of ``c10/cuda/CUDACachingAllocator.cpp``
(``DeviceCachingAllocator``, PyTorch 2.10/2.11), for a CUDA-graph private pool
(``torch.cuda.graph_pool_handle()``: no user allocator) with the default
settings; function names are PyTorch's.

Both modes:

- ``round_size``: a request rounds up to a multiple of 512 B (at least 512 B).
- ``get_pool``: rounded size <= 1 MiB goes to the pool's small block pool,
  larger to its large block pool; each has its own free list and segments.
- ``get_free_block``: the smallest free block on the request's stream that is
  large enough, lowest address on ties (a set ordered by stream, size, ptr).
- ``free_block`` / ``try_merge_blocks``: a freed block merges with free
  neighbours in the same segment.
- A graph pool never gives memory back while a graph uses it
  (``release_cached_blocks`` only releases pools whose graphs were all
  destroyed), so ``reserved`` only grows.

Native mode (``expandable_segments`` off):

- ``alloc_block``: one ``cudaMalloc`` per miss, of ``get_allocation_size``:
  2 MiB (small), 20 MiB (large under 10 MiB), else the request rounded up to
  2 MiB. Each is a segment.
- ``should_split``: the remainder becomes a free block when it is >= 512 B
  (small pool) or > 1 MiB (large pool); otherwise the whole block is handed
  out.

Expandable mode (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``;
``malloc`` turns it on for every pool without a user allocator, graph pools
included):

- ``find_expandable_block``: one expandable segment per (small/large block
  pool, stream), created on the first miss. It reserves virtual space for
  1.125x the device's memory, so it is never outgrown and never followed by a
  second one.
- ``try_allocate_expandable_block`` / ``map_block``: a miss maps whole pages,
  2 MiB (``kSmallBuffer``) in the small pool and 20 MiB
  (``large_segment_size()``, default ``kLargeBuffer``) in the large pool, at
  the segment's mapped end: ceil(request / page) pages after the last block,
  or, when the last block is free but too small (s bytes), ceil((request - s)
  / page) pages merged into it. The request size is the rounded request, not
  ``get_allocation_size``.
- ``reserved`` counts mapped pages only, and a memory snapshot reports one
  segment per contiguous mapped range: here one per expandable segment, its
  mapped bytes.
- ``should_split``: the remainder is split off when it is >= 512 B in both
  pools (the large pool's 1 MiB rule does not apply).
- ``get_free_block``: best fit ranks a block by its size plus the unmapped
  space behind it, so the free block at a segment's mapped end ranks last: it
  is taken only when no other free block on the stream fits (the search steps
  from it to the next larger block).
- Nothing is unmapped while a graph uses the pool (``unmap_block`` only runs
  from ``release_blocks`` on released pools and on out-of-memory paths).

Not modelled: ``max_split_size_mb`` / ``max_non_split_rounding_mb``,
``roundup_power2_divisions``, ``garbage_collection_threshold``, a
non-default ``large_segment_size``, out-of-memory retries, memory pools with a
user allocator or ``no_split``, and cross-stream uses (``record_stream``,
events, ``graph_capture_record_stream_reuse``): blocks here are freed
immediately, as a capture on one stream sees them.
``bench/allocator_diff.py`` checks this model against the real allocator on a
GPU, in both modes.

Two cores run these rules: :class:`PoolSim` here, the reference and the
fallback, and ``planner/memory/_core.pyx``, the same in C (an optional extension;
its speed: docs/design.md), which :func:`core` chooses where it was built.
``tests/test_allocator_core.py`` drives both with random op streams and
capture programs and compares every address and the final state: a rule
changed here must change there too.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Iterator

from capture_plan.schemas.units import KiB, MiB

__all__ = [
    "PoolSim",
    "Block",
    "FREE",
    "CARRY",
    "round_size",
    "segment_size",
    "KiB",
    "MiB",
    "MIN_BLOCK",
    "SMALL_SIZE",
    "SMALL_BUFFER",
    "LARGE_BUFFER",
    "MIN_LARGE_ALLOC",
    "ROUND_LARGE",
]

MIN_BLOCK = 512
SMALL_SIZE = 1 * MiB
SMALL_BUFFER = 2 * MiB
LARGE_BUFFER = 20 * MiB
MIN_LARGE_ALLOC = 10 * MiB
ROUND_LARGE = 2 * MiB

#: ``nbytes`` of a free in :meth:`PoolSim.run`'s compact ``(nbytes, id)`` ops
#: (the inner loop tests ``nbytes < 0``). Callers build ops from typed
#: programs (planner/memory/program.py), never by writing this value themselves.
FREE = -1

#: id, inside a repeated body (planner/memory/program.py's ``Program``), of the block carried in
#: from before it: :meth:`PoolSim.capture` passes it from one repetition to the next
#: (planner/memory/_core.pyx has the same value; tests/test_allocator_core.py checks it)
CARRY = -1


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def round_size(n: int) -> int:
    """Bytes the allocator hands out for a request of ``n`` bytes."""
    return MIN_BLOCK if n < MIN_BLOCK else _round_up(n, MIN_BLOCK)


def segment_size(rounded: int) -> int:
    """Bytes of the cudaMalloc made when no free block fits ``rounded``."""
    if rounded <= SMALL_SIZE:
        return SMALL_BUFFER
    if rounded < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return _round_up(rounded, ROUND_LARGE)


class Block:
    """One block of a segment (a plain slotted class: equal only to itself)."""

    __slots__ = ("addr", "size", "stream", "small", "segment", "free", "prev", "next", "tail")

    def __init__(
        self,
        addr: int,
        size: int,
        stream: int,
        small: bool,
        segment: int,
        free: bool = True,
        prev: Block | None = None,
        next: Block | None = None,  # noqa: A002 (the allocator's own name for it)
        tail: bool = False,
    ) -> None:
        self.addr, self.size, self.stream, self.small, self.segment = addr, size, stream, small, segment
        self.free, self.prev, self.next = free, prev, next
        #: expandable mode: this block ends at its segment's mapped end
        self.tail = tail

    def __repr__(self) -> str:
        return f"Block(addr={self.addr:#x}, size={self.size}, stream={self.stream}, free={self.free})"


#: free-list keys: (stream << _STREAM_SHIFT) | (size << _SIZE_SHIFT) | addr, one int
#: ordered as get_free_block's (stream, size, ptr) set; addresses and sizes are below 2**64
_SIZE_SHIFT = 64
_STREAM_SHIFT = 128


def _key(b: Block) -> int:
    return (b.stream << _STREAM_SHIFT) | (b.size << _SIZE_SHIFT) | b.addr


class PoolSim:
    """One private graph pool. ``alloc`` returns a handle for ``free``.

    ``segments`` counts segments (cudaMallocs, or expandable segments);
    ``segment_sizes()`` and ``layout()`` describe them as a memory snapshot
    does.

    Best fit breaks ties between equal free blocks by address, so in native
    mode the order of the segments' addresses can matter. By default each new
    segment lies above the previous ones; ``addresses`` (an iterator of ints)
    gives new segments other base addresses instead, e.g. the real
    allocator's in a differential test. Expandable mode never compares blocks
    of different segments (one per block pool and stream).

    Streams are small non-negative ints. Each free list is a sorted list of
    single-int keys (see ``_key``) plus a key -> block dict: the inner loop
    compares and moves ints, never builds tuples.
    """

    __slots__ = (
        "expandable",
        "addresses",
        "reserved",
        "allocated",
        "peak_reserved",
        "peak_allocated",
        "segments",
        "_small",
        "_large",
        "_blocks",
        "_next_addr",
        "_tails",
        "_heads",
        "_seg_small",
        "_seg_bytes",
    )

    def __init__(self, expandable: bool = False, addresses: Iterator[int] | None = None) -> None:
        self.expandable = expandable
        self.addresses = addresses
        self.reserved = self.allocated = self.peak_reserved = self.peak_allocated = self.segments = 0
        self._small: list = []
        self._large: list = []
        self._blocks: dict = {}  # free-list key -> free Block
        self._next_addr = 1 << 32
        # expandable mode: (small, stream) -> last block of that virtual segment
        self._tails: dict = {}
        # per segment: its first block, whether it is a small-pool segment, its bytes
        self._heads: list = []
        self._seg_small: list = []
        self._seg_bytes: list = []

    # -- free lists: sorted (stream, size, addr) keys per small/large pool ----
    def _remove(self, b: Block) -> None:
        lst = self._small if b.small else self._large
        key = (b.stream << _STREAM_SHIFT) | (b.size << _SIZE_SHIFT) | b.addr
        del lst[bisect_left(lst, key)]
        del self._blocks[key]

    def free_blocks(self, small: bool, stream: int = 0) -> list[tuple[int, int]]:
        """(size, addr) of the free blocks, smallest first (for tests and plots)."""
        return [
            (b.size, b.addr) for k in (self._small if small else self._large) if (b := self._blocks[k]).stream == stream
        ]

    # -- the allocator -----------------------------------------------------
    def alloc(self, nbytes: int, stream: int = 0) -> Block:
        """Allocate ``nbytes`` on ``stream``; the block is the handle for :meth:`free`."""
        live: dict = {}
        self.run(((nbytes, 0),), live, stream)
        return live[0]

    def run(
        self, ops, live: dict, stream: int = 0, spans: set | None = None, watch=(), watched: list | None = None
    ) -> None:
        """Allocate and free in order, on ``stream``: the allocator itself.

        ``ops`` are ``(nbytes, id)`` pairs, the compact form
        ``capture_plan.planner.memory.program.Program.runnable`` builds: ``nbytes >= 0`` allocates
        and stores the block as ``live[id]``; ``nbytes == FREE`` frees
        ``live.pop(id)`` (nothing when ``id`` is not live). ``spans`` gets
        ``(start, end)`` of every block allocated and, only then, ``watched``
        the same for the ids in ``watch``, as allocated (for hazard checks).

        get_free_block, the split of malloc, and free_block with
        try_merge_blocks, inlined in one loop: this is the planner's inner
        loop, and :meth:`alloc` and :meth:`free` are one-op calls of it, so
        there is one implementation of the rules.
        """
        blocks = self._blocks
        small_lst, large_lst = self._small, self._large
        expandable = self.expandable
        prefix = stream << _STREAM_SHIFT
        allocated = self.allocated
        for nbytes, eid in ops:
            if nbytes < 0:
                # free_block + try_merge_blocks. Neighbours in a segment share
                # its block pool and stream, so one free list and one stream
                # prefix serve all three blocks.
                block = live.pop(eid, None)
                if block is None:
                    continue
                if block.free:
                    raise ValueError(f"double free of block at {block.addr:#x}")
                block.free = True
                allocated -= block.size
                lst = small_lst if block.small else large_lst
                bprefix = block.stream << _STREAM_SHIFT
                nb = block.prev
                if nb is not None and nb.free:
                    key = bprefix | (nb.size << _SIZE_SHIFT) | nb.addr
                    del lst[bisect_left(lst, key)]
                    del blocks[key]
                    block.addr = nb.addr
                    block.size += nb.size
                    block.prev = before = nb.prev
                    if before is not None:
                        before.next = block
                    else:
                        self._heads[block.segment] = block
                nb = block.next
                if nb is not None and nb.free:
                    key = bprefix | (nb.size << _SIZE_SHIFT) | nb.addr
                    del lst[bisect_left(lst, key)]
                    del blocks[key]
                    block.size += nb.size
                    block.next = after = nb.next
                    if after is not None:
                        after.prev = block
                    if nb.tail:
                        block.tail = True
                        self._tails[(block.small, block.stream)] = block
                key = bprefix | (block.size << _SIZE_SHIFT) | block.addr
                blocks[key] = block
                insort(lst, key)
                continue
            # round_size, get_pool, get_free_block
            size = MIN_BLOCK if nbytes < MIN_BLOCK else (nbytes + MIN_BLOCK - 1) & -MIN_BLOCK
            small = size <= SMALL_SIZE
            lst = small_lst if small else large_lst
            i = bisect_left(lst, prefix | (size << _SIZE_SHIFT))
            if i < len(lst) and lst[i] >> _STREAM_SHIFT == stream:
                # best fit: smallest adequate block, lowest address on ties; with
                # expandable segments the free block at a segment's mapped end
                # ranks last (get_free_block's expandable_size)
                block = blocks[lst[i]]
                if block.tail and i + 1 < len(lst) and lst[i + 1] >> _STREAM_SHIFT == stream:
                    i += 1
                    block = blocks[lst[i]]
                del blocks[lst.pop(i)]
            else:
                block = self._grow(small, stream, size)
            remaining = block.size - size
            # should_split: with expandable segments both pools split at 512 B
            if (remaining >= MIN_BLOCK) if (small or expandable) else (remaining > SMALL_SIZE):
                nxt = block.next
                rest = Block(block.addr + size, remaining, stream, small, block.segment, True, block, nxt, block.tail)
                if nxt is not None:
                    nxt.prev = rest
                block.next = rest
                block.size = size
                if block.tail:
                    block.tail = False
                    self._tails[(small, stream)] = rest
                key = prefix | (remaining << _SIZE_SHIFT) | rest.addr
                blocks[key] = rest
                insort(lst, key)
            block.free = False
            allocated += block.size
            if allocated > self.peak_allocated:
                self.peak_allocated = allocated
            live[eid] = block
            if spans is not None:
                span = (block.addr, block.addr + block.size)
                spans.add(span)
                if eid in watch:  # watch is non-empty only with spans and watched (see the docstring)
                    watched.append(span)  # pyright: ignore[reportOptionalMemberAccess]
        self.allocated = allocated

    def capture(self, prog, view: bool, spans: set | None = None, outputs: list | None = None) -> None:
        """One capture of ``prog`` (a :class:`capture_plan.planner.memory.program.Program`) on stream 0.

        The prologue, the body ``prog.repeats`` times with the carried block
        passed from one repetition to the next, the epilogue; then the frees
        at the capture's end: temporaries and workspaces, and outputs too when
        ``view`` (outputs held through views). Outputs and library blocks
        otherwise stay allocated. ``spans`` (or None) gets every block
        allocated as ``(start, end)``, and then ``outputs`` (or None) the
        protected outputs among them (:meth:`run`), plus the block the last
        repetition carries out when the program returns it as an output.
        """
        live: dict = {}  # allocation id -> Block
        run = self.run
        code = prog.runnable
        watch = outputs is not None  # record protected outputs where they are allocated
        run(code.prologue, live, 0, spans, code.prologue_outputs if watch else (), outputs)
        carried_kind = None  # the kind of the block under CARRY
        if prog.repeats:
            carried = live.pop(prog.carry_in) if prog.carry_in is not None else None
            seen: dict[tuple, int] | None = {}
            i = 0
            body = code.body
            while i < prog.repeats:
                # The allocator is deterministic: once the state after a layer
                # recurs, the layers in between repeat forever. Skip whole
                # cycles; the peak inside them was already seen. Between
                # layers the allocated blocks are the ones from before the
                # loop plus the carried one (a body that leaked would change
                # `allocated`), so the free lists (compared exactly, see
                # free_state) and that block pin the state.
                if seen is not None:
                    sig = (self.free_state(), carried.addr if carried is not None else None)
                    if sig in seen:
                        period = i - seen[sig]
                        i += (prog.repeats - i) // period * period
                        seen = None
                        continue
                    seen[sig] = i
                if carried is not None:
                    live[CARRY] = carried
                run(body, live, 0, spans, code.body_outputs if watch else (), outputs)
                carried = live.pop(prog.carry_out)
                i += 1
            carried_kind = code.kinds[prog.carry_out]
            if prog.carry_kind is not None:  # the step returns what the last repetition carries out
                carried_kind = prog.carry_kind
                if outputs is not None and prog.carry_kind == "output":
                    # the body ran (prog.repeats), so carried is the block it carried out
                    outputs.append((carried.addr, carried.addr + carried.size))  # pyright: ignore[reportOptionalMemberAccess]
            live[CARRY] = carried
        run(code.epilogue, live, 0, spans, code.epilogue_outputs if watch else (), outputs)
        kinds = code.kinds
        ends = []  # at the end of the capture: temporaries, and outputs held through views
        for eid in live:
            kind = carried_kind if eid == CARRY else kinds[eid]
            if kind == "temp" or kind == "workspace" or (kind == "output" and view):
                ends.append((FREE, eid))
        run(ends, live)

    def _grow(self, small: bool, stream: int, size: int) -> Block:
        if self.expandable:
            return self._grow_expandable(small, stream, size)
        seg = segment_size(size)
        block = Block(self._new_address(seg), seg, stream, small, self.segments)
        self._new_segment(block)
        self._reserve(seg, block.segment)
        return block

    def _new_address(self, span: int) -> int:
        if self.addresses is not None:
            return next(self.addresses)
        addr = self._next_addr
        self._next_addr += _round_up(span, ROUND_LARGE) + ROUND_LARGE
        return addr

    def _new_segment(self, head: Block) -> None:
        self.segments += 1
        self._heads.append(head)
        self._seg_small.append(head.small)
        self._seg_bytes.append(0)

    def _grow_expandable(self, small: bool, stream: int, size: int) -> Block:
        page = SMALL_BUFFER if small else LARGE_BUFFER
        tail = self._tails.get((small, stream))
        if tail is not None and tail.free:
            # Map just enough pages behind the free tail block to fit the request.
            extra = _round_up(size - tail.size, page)
            self._remove(tail)
            tail.size += extra
            self._reserve(extra, tail.segment)
            return tail
        extra = _round_up(size, page)
        if tail is None:
            block = Block(self._new_address(1 << 40), extra, stream, small, self.segments, tail=True)
            self._new_segment(block)
        else:
            block = Block(tail.addr + tail.size, extra, stream, small, tail.segment, prev=tail, tail=True)
            tail.tail = False
            tail.next = block
        self._tails[(small, stream)] = block
        self._reserve(extra, block.segment)
        return block

    def _reserve(self, nbytes: int, segment: int) -> None:
        self._seg_bytes[segment] += nbytes
        self.reserved += nbytes
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    def free_state(self) -> tuple:
        """Reserved and allocated bytes and the free lists' keys: the exact state.

        With the same set of allocated blocks (the caller's business), equal
        values mean identical allocator states: every block is either
        allocated or on a free list, and a key holds stream, size and
        address. O(free blocks), at C speed (two list copies).
        """
        return (self.reserved, self.allocated, tuple(self._small), tuple(self._large))

    def state(self) -> tuple:
        """Everything the pool's future depends on while its allocated blocks stay allocated.

        :meth:`free_state` plus where the next segment goes (native mode), each
        expandable segment's mapped end, and the peaks. Allocated blocks are
        absent on purpose: a block that is never freed is never merged, so its
        boundaries change nothing. Two pools with equal ``state()`` answer
        every later sequence of allocations (and frees of those allocations)
        identically, addresses included -- with the default addresses: an
        ``addresses`` iterator's position is not part of the state.
        """
        tails = tuple(sorted((k, b.addr + b.size, b.free) for k, b in self._tails.items()))
        return (self.free_state(), self._next_addr, tails, self.peak_reserved, self.peak_allocated)

    def free_lists(self) -> tuple:
        """Every free block as (stream, size, addr), small pool first: exact and O(n)."""
        return tuple(
            tuple((b.stream, b.size, b.addr) for k in lst for b in (self._blocks[k],))
            for lst in (self._small, self._large)
        )

    def free(self, block: Block) -> None:
        """Free ``block`` (merging it with free neighbours); a double free raises ValueError."""
        self.run(((FREE, 0),), {0: block}, block.stream)

    def copy(self) -> PoolSim:
        """An independent pool in the same state (blocks copied, O(blocks)).

        Blocks of the copy are new objects: a handle from the original must
        not be freed in the copy. ``addresses``, an iterator, is shared.
        """
        twin = {}
        for head in self._heads:
            b, prev = head, None
            while b is not None:
                c = Block(b.addr, b.size, b.stream, b.small, b.segment, b.free, prev, None, b.tail)
                if prev is not None:
                    prev.next = c
                twin[id(b)] = prev = c
                b = b.next
        twin_pool = PoolSim(self.expandable, self.addresses)
        twin_pool.reserved, twin_pool.allocated = self.reserved, self.allocated
        twin_pool.peak_reserved, twin_pool.peak_allocated = self.peak_reserved, self.peak_allocated
        twin_pool.segments = self.segments
        twin_pool._small = list(self._small)
        twin_pool._large = list(self._large)
        twin_pool._blocks = {k: twin[id(b)] for k, b in self._blocks.items()}
        twin_pool._next_addr = self._next_addr
        twin_pool._tails = {k: twin[id(b)] for k, b in self._tails.items()}
        twin_pool._heads = [twin[id(b)] for b in self._heads]
        twin_pool._seg_small = list(self._seg_small)
        twin_pool._seg_bytes = list(self._seg_bytes)
        return twin_pool

    # -- what a memory snapshot shows ----------------------------------------
    def segment_sizes(self) -> list[tuple[bool, int]]:
        """(small, bytes) of every segment, in creation order (reserved = their sum)."""
        return list(zip(self._seg_small, self._seg_bytes))

    def blocks(self) -> Iterator[Block]:
        """Every block, free or not, segment by segment in creation order, each segment's by
        address: where a copy's handles are found (the block at a handle's address).

        O(blocks): for tests and the GPU differential benchmark, not for the planner's inner loop.
        """
        for head in self._heads:
            b = head
            while b is not None:
                yield b
                b = b.next

    def layout(self) -> list[tuple[bool, int, tuple[tuple[int, bool], ...]]]:
        """Every segment as (small, bytes, ((block size, allocated), ...)), blocks by address.

        O(blocks): for tests and the GPU differential benchmark, not for the
        planner's inner loop.
        """
        out = []
        for small, nbytes, head in zip(self._seg_small, self._seg_bytes, self._heads):
            blocks = []
            b = head
            while b is not None:
                blocks.append((b.size, not b.free))
                b = b.next
            out.append((small, nbytes, tuple(blocks)))
        return out
