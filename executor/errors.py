"""Executor errors: all are :class:`schemas.errors.CapturePlanError`."""

from __future__ import annotations

from schemas.errors import CapturePlanError

__all__ = ["ExecutorError", "EnvironmentMismatch", "CaptureFailed", "StaleOutputError", "VerificationFailed"]


class ExecutorError(CapturePlanError):
    """Root of executor errors."""


class EnvironmentMismatch(ExecutorError):
    """The plan was built for another GPU, torch or backend."""


class CaptureFailed(ExecutorError):
    """Capture stopped at a step; every partial graph was released."""


class StaleOutputError(ExecutorError):
    """A non-owning output was read after another replay in its pool overwrote it."""


class VerificationFailed(ExecutorError):
    """verify() found a graph that corrupts another or reads what it must not."""
