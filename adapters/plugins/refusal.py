"""The plugins' refusals and the setting they name, below :mod:`.core` and :mod:`.live`
(both raise them). Imports neither torch nor an engine."""

from __future__ import annotations

from capture_plan.schemas.errors import CapturePlanError

#: the setting that enables the plugins: the plan file
ENV_PLAN = "CAPTURE_PLAN_PLAN"


class PluginRefused(CapturePlanError):
    """The plugin cannot route this engine's capture through the plan."""


class HooksMoved(PluginRefused):
    """The installed engine's objects are not those of any release the plugin knows."""


class EngineUnavailable(PluginRefused):
    """The engine, or a module of it the plugin uses, cannot be imported."""
