"""The executor's logger, ``capture_plan.executor``.

Engines that embed the executor configure ``logging`` as they do for their
own code; the executor never prints to stderr itself (the optional tqdm bar
of a foreground ``capture(..., progress=True)`` aside).
"""

from __future__ import annotations

import logging

__all__ = ["log", "LOGGER"]

#: the name engines configure (``logging.getLogger("capture_plan.executor")``)
LOGGER = "capture_plan.executor"

log = logging.getLogger(LOGGER)
