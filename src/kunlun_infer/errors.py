"""The error hierarchy: one base class, one subclass per layer that can be at fault.

Every error the library raises on purpose derives from :class:`KunlunInferError`,
so an application can catch the whole family with one ``except``. Messages name
the thing at fault (a config key, a plugin and hook, a request field, a file
and tensor) and say what to do next.
"""

from __future__ import annotations


class KunlunInferError(Exception):
    """Base class of every error raised by kunlun_infer on purpose."""


class ConfigError(KunlunInferError):
    """A composed configuration is invalid: unknown option, bad value, unknown key."""


class PluginError(KunlunInferError):
    """A plugin failed, or does not fit this framework.

    ``plugin`` is the registered plugin name, ``hook`` the hook or capability
    method that failed, ``layer`` the layer at fault (``plugin``, ``runtime``,
    ``hardware``). The original exception, if any, is chained as ``__cause__``.
    """

    def __init__(self, message: str, *, plugin: str | None = None, hook: str | None = None,
                 layer: str = "plugin") -> None:
        super().__init__(message)
        self.plugin = plugin
        self.hook = hook
        self.layer = layer


class PluginVersionError(PluginError):
    """A plugin supports a hook-API range that does not contain this framework's API version."""


class OpsCoverageError(PluginError):
    """``ops.strict=true`` and the chosen ops plugin lacks ops the model needs."""

    def __init__(self, message: str, *, missing: list[str], plugin: str | None = None) -> None:
        super().__init__(message, plugin=plugin, hook="supports", layer="plugin")
        self.missing = list(missing)


class DeviceOutOfMemoryError(KunlunInferError, MemoryError):
    """A device allocation could not be satisfied; carries the numbers."""

    def __init__(self, message: str, *, requested: int, free: int | None = None,
                 capacity: int | None = None) -> None:
        super().__init__(message)
        self.requested = requested
        self.free = free
        self.capacity = capacity


class ModelLoadError(KunlunInferError):
    """A model folder cannot be loaded: missing file, bad config field, corrupt or mismatched tensor."""


class RequestError(KunlunInferError, ValueError):
    """A request was refused; ``field`` names the offending parameter. The engine keeps serving."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class WorkerError(KunlunInferError):
    """A tensor-parallel worker died, hung past the timeout, or reported a failure."""


class EngineStepError(KunlunInferError):
    """A step failed inside the framework or a plugin; the requests of that step were ended.

    ``outputs`` are the final outputs of the requests the failure ended, each
    with ``error`` set. ``plugin``, ``hook`` and ``layer`` name what failed
    (``plugin`` is ``None`` when the framework itself did). ``shut_down`` is
    true when the engine closed itself (``scheduler.on_step_error=shutdown``).
    """

    def __init__(self, message: str, *, outputs: list | tuple = (), plugin: str | None = None,
                 hook: str | None = None, layer: str = "framework", shut_down: bool = False) -> None:
        super().__init__(message)
        self.outputs = list(outputs)
        self.plugin = plugin
        self.hook = hook
        self.layer = layer
        self.shut_down = shut_down
