"""Turn an exception into a :class:`Failure`: which layer, plugin and hook are at fault.

Plugin errors carry their plugin, hook and layer already (the runtime's
guards put them there); the runtime's own layer is reported as
``framework``. An out-of-memory error is the hardware's capacity talking.
Anything else escaped the framework itself.
"""

from __future__ import annotations

from kunlun_infer.errors import ConfigError, DeviceOutOfMemoryError, KunlunInferError, PluginError
from kunlun_infer.tools.doctor.report import Failure


def describe(exc: BaseException) -> str:
    """``Type: message``, with the first line of the original cause when it adds something."""
    text = f"{type(exc).__name__}: {exc}"
    cause = exc.__cause__
    if cause is not None and str(cause) and str(cause) not in text:
        text += f"\ncaused by {type(cause).__name__}: {str(cause).splitlines()[0]}"
    return text


def blame(exc: BaseException, *, plugin: str | None = None, hook: str | None = None,
          next_steps: list[str] | None = None) -> Failure:
    """The failure ``exc`` means; ``plugin``/``hook`` fill in what the exception does not say."""
    steps = list(next_steps or [])
    if isinstance(exc, PluginError):
        layer = "framework" if exc.layer == "runtime" else exc.layer
        if layer not in ("framework", "plugin", "hardware"):
            layer = "plugin"
        return Failure(layer=layer, message=describe(exc), plugin=exc.plugin or plugin, hook=exc.hook or hook,
                       next_steps=steps)
    if isinstance(exc, DeviceOutOfMemoryError):
        return Failure(layer="hardware", message=describe(exc), plugin=plugin, hook=hook or "memory.allocate",
                       next_steps=steps + ["free device memory held by other processes, or lower "
                                           "cache.memory_fraction / scheduler.max_num_batched_tokens"])
    if isinstance(exc, ConfigError):
        return Failure(layer="framework", message=describe(exc), plugin=plugin, hook=hook,
                       next_steps=steps + ["fix the config key named above (kunlun-infer config shows the "
                                           "composed config)"])
    if isinstance(exc, KunlunInferError):
        return Failure(layer="framework", message=describe(exc), plugin=plugin, hook=hook, next_steps=steps)
    return Failure(layer="framework", message=describe(exc), plugin=plugin, hook=hook,
                   next_steps=steps + ["an unexpected error escaped the framework: rerun with --debug and "
                                       "report it with the traceback"])
