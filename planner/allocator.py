"""A private pool of PyTorch's CUDA caching allocator, simulated on the CPU.

Follows the rules in DESIGN §3 (c10 defaults): requests round up to 512 B;
<= 1 MiB goes to the small pool, larger to the large pool; a new segment is
2 MiB (small), 20 MiB (large, under 10 MiB) or the request rounded up to 2 MiB;
best fit on the same stream by (size, address); the allocation takes the low
end of a block and the remainder is split off when it is >= 512 B (small) or
> 1 MiB (large); frees merge with free neighbours in the same segment; a pool
used by graphs never releases segments, so ``reserved`` only grows.

``expandable=True`` models expandable segments: one growing virtual segment
per (small/large, stream), mapped in 2 MiB / 20 MiB pages on demand.

Not modelled: ``max_split_size_mb``, garbage-collection thresholds,
``roundup_power2_divisions``, events/stream-ordered frees across streams
(blocks here are freed immediately, as a capture on one stream sees them).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

__all__ = ["PoolSim", "Block", "round_size", "segment_size", "KiB", "MiB",
           "MIN_BLOCK", "SMALL_SIZE", "SMALL_BUFFER", "LARGE_BUFFER", "MIN_LARGE_ALLOC", "ROUND_LARGE"]

KiB = 1024
MiB = 1024 * KiB
MIN_BLOCK = 512
SMALL_SIZE = 1 * MiB
SMALL_BUFFER = 2 * MiB
LARGE_BUFFER = 20 * MiB
MIN_LARGE_ALLOC = 10 * MiB
ROUND_LARGE = 2 * MiB


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


@dataclass(eq=False, slots=True)
class Block:
    addr: int
    size: int
    stream: int
    small: bool
    segment: int
    free: bool = True
    prev: "Block | None" = None
    next: "Block | None" = None
    #: expandable mode: this block ends at the segment's mapped end
    tail: bool = False


@dataclass(slots=True)
class PoolSim:
    """One private graph pool. ``alloc`` returns a handle for ``free``."""

    expandable: bool = False
    reserved: int = 0
    allocated: int = 0
    peak_reserved: int = 0
    peak_allocated: int = 0
    segments: int = 0
    _free: dict = field(default_factory=lambda: {True: [], False: []})
    _next_addr: int = 1 << 32
    # expandable mode: (small, stream) -> last block of that virtual segment
    _tails: dict = field(default_factory=dict)

    # running sum of the free entries' hashes: free_state() in O(1)
    _fsum: int = 0

    # -- free lists: sorted (stream, size, addr) keys per small/large pool ----
    def _insert(self, b: Block) -> None:
        key = (b.stream, b.size, b.addr)
        self._fsum += hash(key)
        bisect.insort(self._free[b.small], (*key, b))

    def _remove(self, b: Block) -> None:
        lst = self._free[b.small]
        key = (b.stream, b.size, b.addr)
        i = bisect.bisect_left(lst, key)
        assert lst[i][3] is b
        del lst[i]
        self._fsum -= hash(key)

    def _best_fit(self, small: bool, stream: int, size: int) -> Block | None:
        lst = self._free[small]
        i = bisect.bisect_left(lst, (stream, size, -1))
        if i < len(lst) and lst[i][0] == stream:
            return lst[i][3]
        return None

    def free_blocks(self, small: bool, stream: int = 0) -> list[tuple[int, int]]:
        """(size, addr) of the free blocks, smallest first (for tests and plots)."""
        return [(k[1], k[2]) for k in self._free[small] if k[0] == stream]

    # -- the allocator -----------------------------------------------------
    def alloc(self, nbytes: int, stream: int = 0) -> Block:
        size = MIN_BLOCK if nbytes < MIN_BLOCK else -(-nbytes // MIN_BLOCK) * MIN_BLOCK
        small = size <= SMALL_SIZE
        lst = self._free[small]
        i = bisect.bisect_left(lst, (stream, size, -1))
        if i < len(lst) and lst[i][0] == stream:
            st_, sz_, ad_, block = lst.pop(i)  # best fit: smallest adequate block, lowest address on ties
            self._fsum -= hash((st_, sz_, ad_))
        else:
            block = self._grow(small, stream, size)
        remaining = block.size - size
        if (remaining >= MIN_BLOCK) if small else (remaining > SMALL_SIZE):
            rest = Block(block.addr + size, remaining, stream, small, block.segment,
                         prev=block, next=block.next, tail=block.tail)
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            block.size = size
            if block.tail:
                block.tail = False
                self._tails[(small, stream)] = rest
            self._insert(rest)
        block.free = False
        self.allocated += block.size
        if self.allocated > self.peak_allocated:
            self.peak_allocated = self.allocated
        return block

    def _grow(self, small: bool, stream: int, size: int) -> Block:
        if self.expandable:
            return self._grow_expandable(small, stream, size)
        seg = segment_size(size)
        block = Block(self._next_addr, seg, stream, small, self.segments)
        self._next_addr += _round_up(seg, ROUND_LARGE) + ROUND_LARGE
        self.segments += 1
        self._reserve(seg)
        return block

    def _grow_expandable(self, small: bool, stream: int, size: int) -> Block:
        page = SMALL_BUFFER if small else LARGE_BUFFER
        tail = self._tails.get((small, stream))
        if tail is not None and tail.free:
            # Map just enough pages behind the free tail block to fit the request.
            extra = _round_up(size - tail.size, page)
            self._remove(tail)
            tail.size += extra
            self._reserve(extra)
            return tail
        extra = _round_up(size, page)
        if tail is None:
            addr, seg = self._next_addr, self.segments
            self._next_addr += 1 << 40  # virtual reservations are huge
            self.segments += 1
        else:
            addr, seg = tail.addr + tail.size, tail.segment
            tail.tail = False
        block = Block(addr, extra, stream, small, seg, prev=tail, tail=True)
        if tail is not None:
            tail.next = block
        self._tails[(small, stream)] = block
        self._reserve(extra)
        return block

    def _reserve(self, nbytes: int) -> None:
        self.reserved += nbytes
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    def free_state(self) -> tuple:
        """Reserved and allocated bytes and the free blocks, in O(1).

        With the same set of allocated blocks (the caller's business), equal
        free lists mean identical allocator states: every block is either
        allocated or on a free list, and the lists hold address and size.
        The lists are summarized by their lengths and a running sum of their
        entries' hashes, so equal values could, with a probability near
        2**-64, come from different lists; ``free_lists()`` is the exact form.
        """
        return (self.reserved, self.allocated, self._fsum, len(self._free[True]), len(self._free[False]))

    def free_lists(self) -> tuple:
        """Every free block as (stream, size, addr), small pool first: exact and O(n)."""
        return tuple(k[:3] for k in self._free[True]), tuple(k[:3] for k in self._free[False])

    def free(self, block: Block) -> None:
        if block.free:
            raise ValueError(f"double free of block at {block.addr:#x}")
        block.free = True
        self.allocated -= block.size
        for nb in (block.prev, block.next):
            if nb is not None and nb.free:
                self._remove(nb)
                self._merge(block, nb)
        self._insert(block)

    def _merge(self, block: Block, nb: Block) -> None:
        if nb is block.prev:
            block.addr = nb.addr
            block.prev = nb.prev
            if nb.prev is not None:
                nb.prev.next = block
        else:
            block.next = nb.next
            if nb.next is not None:
                nb.next.prev = block
            if nb.tail:
                block.tail = True
                self._tails[(block.small, block.stream)] = block
        block.size += nb.size
