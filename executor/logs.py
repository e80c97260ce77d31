"""The executor's logger, ``capture_plan.executor``, and its rank awareness.

Engines that embed the executor configure ``logging`` as they do for their
own code; the executor never prints to stderr itself (the optional tqdm bar
of a foreground ``capture(..., progress=True)`` aside, on rank 0 only). One
exception: ``load_plan`` reports a plan that does not fit this machine with
``warnings.warn`` (Python's warnings filters decide; it names no rank).

Under ``torch.distributed`` every rank runs the same capture, so progress and
the summary (INFO, DEBUG) are logged by rank 0 of the capture's group only;
warnings and errors concern one rank's own memory or failure and are logged
by every rank, naming it (``capture-plan [rank 3]: ...``).
"""

from __future__ import annotations

import logging

__all__ = ["log", "LOGGER", "rank_tag"]

#: the name engines configure (``logging.getLogger("capture_plan.executor")``)
LOGGER = "capture_plan.executor"

log = logging.getLogger(LOGGER)


def rank_tag() -> str:
    """`` [rank N]`` (the global rank) under torch.distributed, else ""."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return f" [rank {dist.get_rank()}]"
    return ""
