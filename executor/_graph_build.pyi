"""The compiled graph builder's surface (executor/_graph_build.pyx)."""

from collections.abc import Callable, Mapping

CALLS: tuple[str, ...]
KINDS: dict[str, int]
WIDTHS: dict[str, int]
MAX_ATTRIBUTE: int

def layouts() -> dict[str, tuple[int, dict[str, int]]]: ...
def flatten(
    g: object,
    bases: list[int | None],
    function: Callable[..., object],
    functions: dict,
    index: dict[int, int],
    attribute_ids: Mapping[str, int],
) -> tuple: ...

class Builder:
    def __init__(self, addresses: Mapping[str, int], ctx: int) -> None: ...
    def add(
        self,
        graph: int,
        kinds: bytes,
        kernels: object,
        blob: bytes,
        params: object,
        relocs: object,
        attrs: object,
        memsets: object,
        copies: object,
        edges: object,
        functions: int,
    ) -> tuple | None: ...
