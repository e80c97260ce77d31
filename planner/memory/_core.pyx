# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""The compiled allocator core: planner/memory/allocator.py's ``PoolSim`` and its per-capture loop, in C.

The same rules as ``PoolSim`` (planner/memory/allocator.py's docstring cites PyTorch's functions for
each), op for op, over C arrays instead of Python objects: blocks live in one array and are
named by their index, each block pool's free list is a sorted array of (stream, size, addr)
keys, and a program's typed ops are converted to an array once per program. ``PoolSim`` is the reference: ``tests/test_allocator_core.py`` drives both with random
op streams and compares every address and the final state, so a rule changed in one and not
the other fails there. planner/memory/allocator.py chooses this core when it was built (an optional
extension: setup.py) and falls back to ``PoolSim`` otherwise.

Handles: ``alloc`` and ``run`` hand out block indices (ints), valid while the block is
allocated (a freed block's index is reused). ``state()`` and ``free_state()`` return bytes:
equal exactly when ``PoolSim``'s tuples would be, but not the same values. Addresses and
sizes are below 2**63.
"""

import sys

from libc.stdint cimport int32_t, int64_t
from libc.stdlib cimport free, malloc, realloc
from libc.string cimport memcpy, memmove, memset

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize

cdef enum:
    MIN_BLOCK = 512
    SMALL_SIZE = 1048576
    SMALL_BUFFER = 2097152
    LARGE_BUFFER = 20971520
    MIN_LARGE_ALLOC = 10485760
    ROUND_LARGE = 2097152

cdef struct Blk:
    int64_t addr
    int64_t size
    int64_t stream
    int32_t segment
    int32_t prev  # -1: none
    int32_t next
    char small
    char free
    char tail  # expandable mode: ends at its segment's mapped end

cdef struct Key:  # a free-list entry, ordered as get_free_block's (stream, size, ptr) set
    int64_t stream
    int64_t size
    int64_t addr
    int64_t blk

cdef struct FreeList:
    Key* items
    Py_ssize_t n
    Py_ssize_t cap

cdef struct Tail:
    int64_t stream
    int32_t small
    int32_t blk

cdef inline int64_t round_up(int64_t n, int64_t m) noexcept nogil:
    return (n + m - 1) // m * m

cdef inline bint key_less(Key* k, int64_t stream, int64_t size, int64_t addr) noexcept nogil:
    if k.stream != stream:
        return k.stream < stream
    if k.size != size:
        return k.size < size
    return k.addr < addr

cdef inline Py_ssize_t lower(FreeList* f, int64_t stream, int64_t size, int64_t addr) noexcept nogil:
    cdef Py_ssize_t lo = 0, hi = f.n, mid
    while lo < hi:
        mid = (lo + hi) >> 1
        if key_less(&f.items[mid], stream, size, addr):
            lo = mid + 1
        else:
            hi = mid
    return lo

cdef void* grow_array(void* p, Py_ssize_t* cap, Py_ssize_t need, size_t item) except NULL:
    cdef Py_ssize_t c = cap[0]
    if need <= c and p != NULL:
        return p
    while c < need:
        c = c * 2 if c else 16
    cdef void* q = realloc(p, c * item)
    if q == NULL:
        raise MemoryError()
    cap[0] = c
    return q

cdef inline void fl_remove_at(FreeList* f, Py_ssize_t i) noexcept nogil:
    f.n -= 1
    if i < f.n:
        memmove(&f.items[i], &f.items[i + 1], (f.n - i) * sizeof(Key))

cdef inline void fl_remove(FreeList* f, int64_t stream, int64_t size, int64_t addr) noexcept nogil:
    fl_remove_at(f, lower(f, stream, size, addr))

cdef int fl_insert(FreeList* f, int64_t stream, int64_t size, int64_t addr, int64_t blk) except -1:
    if f.n == f.cap:
        f.items = <Key*>grow_array(f.items, &f.cap, f.n + 1, sizeof(Key))
    cdef Py_ssize_t i = lower(f, stream, size, addr)
    if i < f.n:
        memmove(&f.items[i + 1], &f.items[i], (f.n - i) * sizeof(Key))
    f.items[i].stream = stream
    f.items[i].size = size
    f.items[i].addr = addr
    f.items[i].blk = blk
    f.n += 1
    return 0

cdef int fl_copy(FreeList* dst, FreeList* src) except -1:
    dst.items = NULL
    dst.cap = 0
    dst.n = 0
    dst.items = <Key*>grow_array(NULL, &dst.cap, src.n if src.n else 1, sizeof(Key))
    memcpy(dst.items, src.items, src.n * sizeof(Key))
    dst.n = src.n
    return 0

# end-of-capture fate of a block by kind (planner/memory/simulate.py's rule): kept, freed, freed with views
cdef enum:
    KEEP = 0
    FREED = 1
    FREED_IF_VIEW = 2

cdef char end_kind(object kind):
    if kind == "temp" or kind == "workspace":
        return FREED
    if kind == "output":
        return FREED_IF_VIEW
    return KEEP

#: planner/memory/allocator.py's CARRY (program.py's carried block), which tests/test_allocator_core.py
#: checks this equals: the extension imports nothing from the package
CARRY = -1

cdef struct Op:
    int64_t nbytes  # < 0: a free
    int32_t slot
    int32_t output  # an allocation of an output the capture records (its section's output set)


cdef class Compiled:
    """A program's sections as C arrays, its ids as dense slots (built once per program)."""

    cdef Op* ops[3]
    cdef Py_ssize_t n[3]
    cdef int32_t nslots, carry, carry_in, carry_out
    cdef Py_ssize_t repeats
    cdef char* ends  # per slot: KEEP, FREED or FREED_IF_VIEW
    cdef char carried_end
    cdef bint carried_output
    cdef object carry_out_id, carry_in_id

    def __cinit__(self):
        self.ops[0] = self.ops[1] = self.ops[2] = NULL
        self.ends = NULL

    def __dealloc__(self):
        free(self.ops[0])
        free(self.ops[1])
        free(self.ops[2])
        free(self.ends)

    def __init__(self, prog):
        # Straight from the typed ops: what Program.runnable makes for PoolSim (the sections as
        # (nbytes, id) pairs, each id's kind, each section's output ids), without making it.
        # The ops' classes come from the module that defined the program (planner/memory/program.py):
        # this extension imports nothing from the package.
        alloc = sys.modules[type(prog).__module__].Alloc
        sections = (prog.prologue, prog.body, prog.epilogue)
        slots: dict = {CARRY: 0}
        kinds: dict = {}
        watched = []
        for section in sections:
            outs = set()
            for op in section:
                eid = op.id
                if eid not in slots:
                    slots[eid] = len(slots)
                if type(op) is alloc:
                    kinds[eid] = op.kind
                    if op.kind == "output":
                        outs.add(eid)
            watched.append(outs)
        for eid in (prog.carry_in, prog.carry_out):
            if eid is not None and eid not in slots:
                slots[eid] = len(slots)
        self.nslots = len(slots)
        self.carry = 0
        self.carry_in = -1 if prog.carry_in is None else slots[prog.carry_in]
        self.carry_out = slots[prog.carry_out]
        self.carry_in_id, self.carry_out_id = prog.carry_in, prog.carry_out
        self.repeats = prog.repeats
        cdef Py_ssize_t j
        cdef int s
        for s in range(3):
            section = sections[s]
            outs = watched[s]
            self.n[s] = len(section)
            self.ops[s] = <Op*>malloc((len(section) or 1) * sizeof(Op))
            if self.ops[s] == NULL:
                raise MemoryError()
            j = 0
            for op in section:
                if type(op) is alloc:
                    self.ops[s][j].nbytes = op.size
                    self.ops[s][j].output = op.id in outs
                else:
                    self.ops[s][j].nbytes = -1  # FREE
                    self.ops[s][j].output = 0
                self.ops[s][j].slot = slots[op.id]
                j += 1
        self.ends = <char*>malloc(self.nslots)
        if self.ends == NULL:
            raise MemoryError()
        for eid, slot in slots.items():
            self.ends[slot] = end_kind(kinds.get(eid))
        # simulate.py: the carried block ends as the kind of what the body carries out, or as
        # carry_kind; without repetitions CARRY names no carried block and nothing frees it
        self.carried_end = KEEP
        self.carried_output = False
        if self.repeats:
            kind = prog.carry_kind if prog.carry_kind is not None else kinds[prog.carry_out]
            self.carried_end = end_kind(kind)
            self.carried_output = prog.carry_kind == "output"
        self.ends[self.carry] = self.carried_end

    cdef Compiled resized(self, prog):
        """``prog``, a program of this one's structure (the same ops but for allocation sizes,
        the same carries and repeats: planner/memory/workload.py's ``_same_structure``), compiled by
        copying this one's arrays and reading only its allocation sizes."""
        cdef Compiled c = Compiled.__new__(Compiled)
        cdef Py_ssize_t j, n
        cdef int s
        alloc = sys.modules[type(prog).__module__].Alloc
        sections = (prog.prologue, prog.body, prog.epilogue)
        c.nslots, c.carry, c.carry_in, c.carry_out = self.nslots, self.carry, self.carry_in, self.carry_out
        c.carry_in_id, c.carry_out_id = self.carry_in_id, self.carry_out_id
        c.repeats, c.carried_end, c.carried_output = self.repeats, self.carried_end, self.carried_output
        c.ends = <char*>malloc(self.nslots)
        if c.ends == NULL:
            raise MemoryError()
        memcpy(c.ends, self.ends, self.nslots)
        for s in range(3):
            section = sections[s]
            n = self.n[s]
            if len(section) != n:
                raise ValueError("a program said to share a structure has other ops")
            c.n[s] = n
            c.ops[s] = <Op*>malloc((n or 1) * sizeof(Op))
            if c.ops[s] == NULL:
                raise MemoryError()
            memcpy(c.ops[s], self.ops[s], n * sizeof(Op))
            j = 0
            for op in section:  # each op an alloc where the template's is (ids are trusted)
                if type(op) is alloc:
                    if c.ops[s][j].nbytes < 0:
                        raise ValueError("a program said to share a structure has other ops")
                    c.ops[s][j].nbytes = op.size
                elif c.ops[s][j].nbytes >= 0:
                    raise ValueError("a program said to share a structure has other ops")
                j += 1
        return c


cdef Compiled compiled(prog):
    """``prog``'s compiled form, built once and kept in ``prog.__dict__`` (as ``runnable``
    is for PoolSim); from the compiled form of the program it shares its structure with
    (``_same_structure``), where it has one, by copying and resizing that."""
    cdef dict d = prog.__dict__
    cdef Compiled c = d.get("_compiled_core")
    if c is not None:
        return c
    like = d.get("_same_structure")
    c = compiled(like).resized(prog) if like is not None else Compiled(prog)
    d["_compiled_core"] = c
    return c


cdef class Pool:
    """One private graph pool (``PoolSim``'s surface; see the module docstring)."""

    cdef Blk* blk
    cdef Py_ssize_t nblk, capblk
    cdef int32_t* spare  # indices of released blocks, reused first
    cdef Py_ssize_t nspare, capspare
    cdef FreeList fl[2]  # [0]: large pool, [1]: small pool
    cdef int32_t* heads
    cdef char* seg_small
    cdef int64_t* seg_bytes
    cdef Py_ssize_t nseg, capseg
    cdef Tail* tails
    cdef Py_ssize_t ntails, captails
    cdef int64_t next_addr
    cdef readonly bint expandable
    cdef public object addresses
    cdef readonly int64_t reserved, allocated, peak_reserved, peak_allocated

    def __cinit__(self, bint expandable=False, addresses=None):
        self.expandable = expandable
        self.addresses = addresses
        self.next_addr = 1LL << 32
        # (cdef class fields start zeroed: NULL arrays, empty free lists)

    def __dealloc__(self):
        free(self.blk)
        free(self.spare)
        free(self.heads)
        free(self.seg_small)
        free(self.seg_bytes)
        free(self.tails)
        free(self.fl[0].items)
        free(self.fl[1].items)

    @property
    def segments(self) -> int:
        return self.nseg

    # -- storage -------------------------------------------------------------
    cdef int32_t new_block(self) except -1:
        """A free index in ``blk`` (may move ``blk``: callers hold indices, not pointers)."""
        if self.nspare:
            self.nspare -= 1
            return self.spare[self.nspare]
        if self.nblk == self.capblk:
            self.blk = <Blk*>grow_array(self.blk, &self.capblk, self.nblk + 1, sizeof(Blk))
        self.nblk += 1
        return <int32_t>(self.nblk - 1)

    cdef int release(self, int32_t b) except -1:
        if self.nspare == self.capspare:
            self.spare = <int32_t*>grow_array(self.spare, &self.capspare, self.nspare + 1, sizeof(int32_t))
        self.spare[self.nspare] = b
        self.nspare += 1
        return 0

    cdef int new_segment(self, int32_t head, bint small) except -1:
        cdef Py_ssize_t cap = self.capseg
        if self.nseg == cap:
            self.heads = <int32_t*>grow_array(self.heads, &cap, self.nseg + 1, sizeof(int32_t))
            cap = self.capseg
            self.seg_small = <char*>grow_array(self.seg_small, &cap, self.nseg + 1, sizeof(char))
            cap = self.capseg
            self.seg_bytes = <int64_t*>grow_array(self.seg_bytes, &cap, self.nseg + 1, sizeof(int64_t))
            self.capseg = cap
        self.heads[self.nseg] = head
        self.seg_small[self.nseg] = small
        self.seg_bytes[self.nseg] = 0
        self.nseg += 1
        return 0

    cdef inline void reserve(self, int64_t nbytes, int32_t segment) noexcept:
        self.seg_bytes[segment] += nbytes
        self.reserved += nbytes
        if self.reserved > self.peak_reserved:
            self.peak_reserved = self.reserved

    cdef int32_t get_tail(self, bint small, int64_t stream) noexcept:
        for i in range(self.ntails):
            if self.tails[i].small == small and self.tails[i].stream == stream:
                return self.tails[i].blk
        return -1

    cdef int set_tail(self, bint small, int64_t stream, int32_t b) except -1:
        for i in range(self.ntails):
            if self.tails[i].small == small and self.tails[i].stream == stream:
                self.tails[i].blk = b
                return 0
        if self.ntails == self.captails:
            self.tails = <Tail*>grow_array(self.tails, &self.captails, self.ntails + 1, sizeof(Tail))
        self.tails[self.ntails].small = small
        self.tails[self.ntails].stream = stream
        self.tails[self.ntails].blk = b
        self.ntails += 1
        return 0

    cdef int64_t new_address(self, int64_t span) except? -1:
        if self.addresses is not None:
            return next(self.addresses)
        cdef int64_t addr = self.next_addr
        self.next_addr += round_up(span, ROUND_LARGE) + ROUND_LARGE
        return addr

    # -- the allocator ---------------------------------------------------------
    cdef int32_t grow(self, bint small, int64_t stream, int64_t size) except -1:
        cdef int64_t seg, addr
        cdef int32_t b
        if self.expandable:
            return self.grow_expandable(small, stream, size)
        if size <= SMALL_SIZE:
            seg = SMALL_BUFFER
        elif size < MIN_LARGE_ALLOC:
            seg = LARGE_BUFFER
        else:
            seg = round_up(size, ROUND_LARGE)
        addr = self.new_address(seg)
        b = self.new_block()
        self.blk[b] = Blk(addr, seg, stream, <int32_t>self.nseg, -1, -1, small, 1, 0)
        self.new_segment(b, small)
        self.reserve(seg, self.blk[b].segment)
        return b

    cdef int32_t grow_expandable(self, bint small, int64_t stream, int64_t size) except -1:
        cdef int64_t page = SMALL_BUFFER if small else LARGE_BUFFER
        cdef int64_t extra, addr
        cdef int32_t b, t = self.get_tail(small, stream)
        if t >= 0 and self.blk[t].free:
            # map just enough pages behind the free tail block to fit the request
            extra = round_up(size - self.blk[t].size, page)
            fl_remove(&self.fl[small], stream, self.blk[t].size, self.blk[t].addr)
            self.blk[t].size += extra
            self.reserve(extra, self.blk[t].segment)
            return t
        extra = round_up(size, page)
        if t < 0:
            addr = self.new_address(1LL << 40)
            b = self.new_block()
            self.blk[b] = Blk(addr, extra, stream, <int32_t>self.nseg, -1, -1, small, 1, 1)
            self.new_segment(b, small)
        else:
            b = self.new_block()
            self.blk[b] = Blk(
                self.blk[t].addr + self.blk[t].size, extra, stream, self.blk[t].segment, t, -1, small, 1, 1
            )
            self.blk[t].tail = 0
            self.blk[t].next = b
        self.set_tail(small, stream, b)
        self.reserve(extra, self.blk[b].segment)
        return b

    cdef int32_t do_alloc(self, int64_t nbytes, int64_t stream) except -1:
        """round_size, get_pool, get_free_block, the split of malloc (PoolSim.run's alloc branch)."""
        cdef int64_t size = MIN_BLOCK if nbytes < MIN_BLOCK else (nbytes + MIN_BLOCK - 1) & -MIN_BLOCK
        cdef bint small = size <= SMALL_SIZE
        cdef FreeList* f = &self.fl[small]
        cdef Py_ssize_t i = lower(f, stream, size, 0)
        cdef int32_t b, r, nxt
        cdef int64_t remaining
        if i < f.n and f.items[i].stream == stream:
            # best fit; with expandable segments the free block at a segment's mapped end ranks last
            b = <int32_t>f.items[i].blk
            if self.blk[b].tail and i + 1 < f.n and f.items[i + 1].stream == stream:
                i += 1
                b = <int32_t>f.items[i].blk
            fl_remove_at(f, i)
        else:
            b = self.grow(small, stream, size)
        remaining = self.blk[b].size - size
        # should_split: with expandable segments both pools split at 512 B
        if (remaining >= MIN_BLOCK) if (small or self.expandable) else (remaining > SMALL_SIZE):
            r = self.new_block()
            nxt = self.blk[b].next
            self.blk[r] = Blk(
                self.blk[b].addr + size, remaining, stream, self.blk[b].segment, b, nxt, small, 1, self.blk[b].tail
            )
            if nxt >= 0:
                self.blk[nxt].prev = r
            self.blk[b].next = r
            self.blk[b].size = size
            if self.blk[b].tail:
                self.blk[b].tail = 0
                self.set_tail(small, stream, r)
            fl_insert(f, stream, remaining, self.blk[r].addr, r)
        self.blk[b].free = 0
        self.allocated += self.blk[b].size
        if self.allocated > self.peak_allocated:
            self.peak_allocated = self.allocated
        return b

    cdef int do_free(self, int32_t b) except -1:
        """free_block + try_merge_blocks (PoolSim.run's free branch)."""
        cdef Blk* x = &self.blk[b]
        cdef int32_t nb, before, after
        if x.free:
            raise ValueError(f"double free of block at {x.addr:#x}")
        x.free = 1
        self.allocated -= x.size
        cdef FreeList* f = &self.fl[<int>x.small]
        nb = x.prev
        if nb >= 0 and self.blk[nb].free:
            fl_remove(f, x.stream, self.blk[nb].size, self.blk[nb].addr)
            x.addr = self.blk[nb].addr
            x.size += self.blk[nb].size
            x.prev = before = self.blk[nb].prev
            if before >= 0:
                self.blk[before].next = b
            else:
                self.heads[x.segment] = b
            self.release(nb)
        nb = x.next
        if nb >= 0 and self.blk[nb].free:
            fl_remove(f, x.stream, self.blk[nb].size, self.blk[nb].addr)
            x.size += self.blk[nb].size
            x.next = after = self.blk[nb].next
            if after >= 0:
                self.blk[after].prev = b
            if self.blk[nb].tail:
                x.tail = 1
                self.set_tail(x.small, x.stream, b)
            self.release(nb)
        fl_insert(f, x.stream, x.size, x.addr, b)
        return 0

    cdef int check_handle(self, Py_ssize_t b) except -1:
        if b < 0 or b >= self.nblk:
            raise ValueError(f"no block has handle {b}")
        return 0

    # -- PoolSim's surface -----------------------------------------------------------
    def alloc(self, int64_t nbytes, int64_t stream=0) -> int:
        """Allocate ``nbytes`` on ``stream``; the handle (an int) is for :meth:`free`."""
        if nbytes < 0 or stream < 0:
            raise ValueError("sizes and streams are non-negative")
        return self.do_alloc(nbytes, stream)

    def free(self, Py_ssize_t block) -> None:
        """Free the block with this handle; a double free raises ValueError."""
        self.check_handle(block)
        self.do_free(<int32_t>block)

    def block(self, Py_ssize_t handle) -> tuple:
        """(addr, size, allocated) of the block with this handle."""
        self.check_handle(handle)
        cdef Blk* x = &self.blk[handle]
        return (x.addr, x.size, not x.free)

    def run(self, ops, dict live, int64_t stream=0, spans=None, watch=(), watched=None) -> None:
        """PoolSim.run: ``(nbytes, id)`` ops; ``live`` maps ids to handles (ints)."""
        cdef int64_t nbytes
        cdef int32_t b
        if stream < 0:
            raise ValueError("streams are non-negative")
        for nbytes, eid in ops:
            if nbytes < 0:
                h = live.pop(eid, None)
                if h is not None:
                    self.check_handle(h)
                    self.do_free(<int32_t>h)
                continue
            b = self.do_alloc(nbytes, stream)
            live[eid] = b
            if spans is not None:
                span = (self.blk[b].addr, self.blk[b].addr + self.blk[b].size)
                spans.add(span)
                if eid in watch:
                    watched.append(span)

    cdef int run_section(
        self, Compiled c, int s, int32_t* live, object spans, object outputs
    ) except -1:
        cdef Op* op = c.ops[s]
        cdef Op* end = op + c.n[s]
        cdef int32_t h
        while op < end:
            if op.nbytes < 0:
                h = live[op.slot]
                if h >= 0:
                    live[op.slot] = -1
                    self.do_free(h)
            else:
                h = self.do_alloc(op.nbytes, 0)
                live[op.slot] = h
                if spans is not None:
                    span = (self.blk[h].addr, self.blk[h].addr + self.blk[h].size)
                    spans.add(span)
                    if op.output and outputs is not None:
                        outputs.append(span)
            op += 1
        return 0

    cdef bytes free_sig(self, int64_t carried_addr):
        """reserved, allocated, ``carried_addr`` and every free-list key (stream, size, addr): exact."""
        cdef Py_ssize_t n0 = self.fl[1].n, n1 = self.fl[0].n, k = 0, i
        cdef int s, j
        cdef bytes out = PyBytes_FromStringAndSize(NULL, (4 + 3 * (n0 + n1)) * sizeof(int64_t))
        cdef int64_t* p = <int64_t*>PyBytes_AS_STRING(out)
        p[0] = self.reserved
        p[1] = self.allocated
        p[2] = carried_addr
        p[3] = n0
        k = 4
        for j in range(2):
            s = 1 - j  # small pool first, as PoolSim.free_state
            for i in range(self.fl[s].n):
                p[k] = self.fl[s].items[i].stream
                p[k + 1] = self.fl[s].items[i].size
                p[k + 2] = self.fl[s].items[i].addr
                k += 3
        return out

    def capture(self, prog, bint view, spans=None, outputs=None) -> None:
        """PoolSim.capture, in C: one capture of ``prog`` (a planner.memory.program.Program) on stream 0.

        ``prog`` keeps its compiled form (``prog.__dict__``, as it keeps ``runnable``, which this
        core never needs), so a program is converted once however often it is captured, and
        programs of one structure are converted once for all (:func:`compiled`).
        """
        cdef Compiled c = compiled(prog)
        cdef int32_t* live = <int32_t*>malloc(c.nslots * sizeof(int32_t))
        cdef int32_t carried = -1, h
        cdef Py_ssize_t i = 0, period
        cdef dict seen
        if live == NULL:
            raise MemoryError()
        try:
            for i in range(c.nslots):
                live[i] = -1
            self.run_section(c, 0, live, spans, outputs)
            if c.repeats:
                if c.carry_in >= 0:
                    carried = live[c.carry_in]
                    if carried < 0:
                        raise KeyError(c.carry_in_id)
                    live[c.carry_in] = -1
                seen = {}
                i = 0
                while i < c.repeats:
                    # PoolSim.capture: once the state after a layer recurs, skip whole cycles
                    if seen is not None:
                        sig = self.free_sig(self.blk[carried].addr if carried >= 0 else -1)
                        if sig in seen:
                            period = i - <Py_ssize_t>seen[sig]
                            i += (c.repeats - i) // period * period
                            seen = None
                            continue
                        seen[sig] = i
                    if carried >= 0:
                        live[c.carry] = carried
                    self.run_section(c, 1, live, spans, outputs)
                    carried = live[c.carry_out]
                    if carried < 0:
                        raise KeyError(c.carry_out_id)
                    live[c.carry_out] = -1
                    i += 1
                if c.carried_output and outputs is not None:
                    outputs.append((self.blk[carried].addr, self.blk[carried].addr + self.blk[carried].size))
                live[c.carry] = carried
            self.run_section(c, 2, live, spans, outputs)
            for i in range(c.nslots):
                h = live[i]
                if h >= 0 and (c.ends[i] == FREED or (c.ends[i] == FREED_IF_VIEW and view)):
                    self.do_free(h)
        finally:
            free(live)

    def free_state(self) -> bytes:
        """PoolSim.free_state's information, as bytes (equal exactly when the free lists are)."""
        return self.free_sig(-1)

    def state(self) -> bytes:
        """PoolSim.state's information, as bytes: the free state, where the next segment goes,
        each expandable segment's (block pool, stream, mapped end, whether its last block is
        free) in order, and the peaks."""
        cdef Blk* t
        tails = []
        for i in range(self.ntails):
            t = &self.blk[self.tails[i].blk]
            tails.append((self.tails[i].small, self.tails[i].stream, t.addr + t.size, t.free))
        tails.sort()
        cdef Py_ssize_t n = 3 + 4 * len(tails), k = 3
        cdef bytes extra = PyBytes_FromStringAndSize(NULL, n * sizeof(int64_t))
        cdef int64_t* p = <int64_t*>PyBytes_AS_STRING(extra)
        p[0] = self.next_addr
        p[1] = self.peak_reserved
        p[2] = self.peak_allocated
        for small, stream, end, is_free in tails:
            p[k] = small
            p[k + 1] = stream
            p[k + 2] = end
            p[k + 3] = is_free
            k += 4
        return self.free_sig(-1) + extra

    def free_lists(self) -> tuple:
        """Every free block as (stream, size, addr), small pool first (PoolSim.free_lists)."""
        cdef Key* k
        cdef FreeList* f
        cdef int j
        out = []
        for j in range(2):
            f = &self.fl[1 - j]  # small pool first
            lst = []
            for i in range(f.n):
                k = &f.items[i]
                lst.append((k.stream, k.size, k.addr))
            out.append(tuple(lst))
        return tuple(out)

    def free_blocks(self, bint small, int64_t stream=0) -> list:
        """(size, addr) of the free blocks on ``stream``, smallest first (PoolSim.free_blocks)."""
        cdef FreeList* f = &self.fl[small]
        return [(f.items[i].size, f.items[i].addr) for i in range(f.n) if f.items[i].stream == stream]

    def segment_sizes(self) -> list:
        """(small, bytes) of every segment, in creation order (PoolSim.segment_sizes)."""
        return [(bool(self.seg_small[i]), self.seg_bytes[i]) for i in range(self.nseg)]

    def layout(self) -> list:
        """Every segment as (small, bytes, ((block size, allocated), ...)) (PoolSim.layout)."""
        out = []
        cdef int32_t b
        for i in range(self.nseg):
            blocks = []
            b = self.heads[i]
            while b >= 0:
                blocks.append((self.blk[b].size, not self.blk[b].free))
                b = self.blk[b].next
            out.append((bool(self.seg_small[i]), self.seg_bytes[i], tuple(blocks)))
        return out

    def copy(self) -> Pool:
        """An independent pool in the same state; handles stay valid in the copy (same indices)."""
        cdef Pool twin = Pool.__new__(Pool, self.expandable, self.addresses)
        twin.next_addr = self.next_addr
        twin.reserved, twin.allocated = self.reserved, self.allocated
        twin.peak_reserved, twin.peak_allocated = self.peak_reserved, self.peak_allocated
        twin.blk = <Blk*>grow_array(NULL, &twin.capblk, self.nblk or 1, sizeof(Blk))
        memcpy(twin.blk, self.blk, self.nblk * sizeof(Blk))
        twin.nblk = self.nblk
        twin.spare = <int32_t*>grow_array(NULL, &twin.capspare, self.nspare or 1, sizeof(int32_t))
        memcpy(twin.spare, self.spare, self.nspare * sizeof(int32_t))
        twin.nspare = self.nspare
        cdef Py_ssize_t cap = 0
        twin.heads = <int32_t*>grow_array(NULL, &cap, self.nseg or 1, sizeof(int32_t))
        cap = 0
        twin.seg_small = <char*>grow_array(NULL, &cap, self.nseg or 1, sizeof(char))
        cap = 0
        twin.seg_bytes = <int64_t*>grow_array(NULL, &cap, self.nseg or 1, sizeof(int64_t))
        twin.capseg = cap
        memcpy(twin.heads, self.heads, self.nseg * sizeof(int32_t))
        memcpy(twin.seg_small, self.seg_small, self.nseg * sizeof(char))
        memcpy(twin.seg_bytes, self.seg_bytes, self.nseg * sizeof(int64_t))
        twin.nseg = self.nseg
        twin.tails = <Tail*>grow_array(NULL, &twin.captails, self.ntails or 1, sizeof(Tail))
        memcpy(twin.tails, self.tails, self.ntails * sizeof(Tail))
        twin.ntails = self.ntails
        fl_copy(&twin.fl[0], &self.fl[0])
        fl_copy(&twin.fl[1], &self.fl[1])
        return twin
