"""Where a TMA descriptor keeps its global address: the question a relocation of sm90 kernels needs answered.

A ``CUtensorMap`` is 128 opaque bytes that encode a global address among a tensor's shape,
strides and tile (cuda.h). FA3's and cuBLAS's sm90 kernels take descriptors inside larger
parameter structs, where the graph file's plain 8-byte-word scan (``graph_walk``) sees them
only if the descriptor holds its address as a plain word. :func:`probe_tensor_map` asks this
driver: it encodes the same 2-D tile (``cuTensorMapEncodeTiled``, host-side, nothing
allocated) for two addresses and reports which of the 16 words differ and whether the
address is one of them as it is (:func:`address_words`). A descriptor whose only
address-dependent word holds the plain address is relocated by the scan like any pointer;
any other answer means a restore must re-encode descriptors (``cuTensorMapReplaceAddress``)
or refuse their kernels.

Constraints: one encoding (unsigned bytes, rank 2, no interleave, swizzle, L2 promotion or
fill); another data type or swizzle could lay the address out otherwise. An ExecutorError
where the driver lacks the call or refuses the encoding.
"""

from __future__ import annotations

import ctypes
from dataclasses import asdict, dataclass

from . import libcuda
from .errors import ExecutorError

__all__ = ["TensorMapLayout", "address_words", "probe_tensor_map"]

#: two 16-byte-aligned addresses the probe encodes (never dereferenced: encoding is host-side)
ADDRESSES = (0x7F12_3456_0000, 0x7F65_4321_0000)
_WORDS = 16  # CU_TENSOR_MAP_NUM_QWORDS


@dataclass(frozen=True)
class TensorMapLayout:
    #: indexes of the words that differ between the two encodings
    address_words: list[int]
    #: indexes of the words that hold the address as it is, in both encodings
    plain_words: list[int]
    #: the differing words of both encodings, in hex (what a re-encoding must reproduce)
    values: dict[int, tuple[str, str]]

    @property
    def plain(self) -> bool:
        """The address is one plain word and nothing else depends on it: the scan relocates it."""
        return self.address_words == self.plain_words and len(self.plain_words) == 1

    def as_dict(self) -> dict:
        return {**asdict(self), "plain": self.plain}


def address_words(first: list[int], second: list[int], addresses: tuple[int, int] = ADDRESSES) -> TensorMapLayout:
    """The layout two encodings (16 words each) of one tensor map at ``addresses`` show."""
    differ = [i for i, (a, b) in enumerate(zip(first, second)) if a != b]
    plain = [i for i in differ if (first[i], second[i]) == addresses]
    values = {i: (hex(first[i]), hex(second[i])) for i in differ}
    return TensorMapLayout(address_words=differ, plain_words=plain, values=values)


def _encode(calls: dict, address: int) -> list[int]:
    # a CUtensorMap is 64-byte aligned (cuda.h: alignas(64)); ctypes aligns an array to its element
    raw = (ctypes.c_uint64 * (_WORDS + 8))()
    at = (ctypes.addressof(raw) + 63) // 64 * 64
    desc = (ctypes.c_uint64 * _WORDS).from_address(at)
    dims = (ctypes.c_uint64 * 2)(256, 64)
    strides = (ctypes.c_uint64 * 1)(256)  # bytes between rows: a multiple of 16
    box, steps = (ctypes.c_uint * 2)(64, 16), (ctypes.c_uint * 2)(1, 1)
    rc = calls["cuTensorMapEncodeTiled"](
        ctypes.cast(desc, ctypes.c_void_p), 0, 2, ctypes.c_void_p(address), dims, strides, box, steps, 0, 0, 0, 0
    )
    if rc != 0:
        raise ExecutorError(f"cuTensorMapEncodeTiled failed (CUresult {rc})", where="tensor map probe")
    return list(desc)  # read while raw, which holds it, is alive


def probe_tensor_map(calls: dict | None = None) -> TensorMapLayout:
    """This driver's answer (module docstring)."""
    d = calls if calls is not None else libcuda.calls("cuTensorMapEncodeTiled")
    if isinstance(d, str):
        raise ExecutorError(f"the tensor map probe cannot run: {d}", where="tensor map probe")
    return address_words(_encode(d, ADDRESSES[0]), _encode(d, ADDRESSES[1]))
