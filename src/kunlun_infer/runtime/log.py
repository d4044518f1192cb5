"""Per-layer loggers and DEBUG tracing of every call into a plugin.

Loggers: ``kunlun_infer.framework`` (engine), ``kunlun_infer.runtime`` (this
package) and ``kunlun_infer.plugin.<name>`` (one per plugin). The library only
emits records; configuring handlers is the application's business.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

FRAMEWORK_LOGGER = "kunlun_infer.framework"
RUNTIME_LOGGER = "kunlun_infer.runtime"
PLUGIN_LOGGER_PREFIX = "kunlun_infer.plugin."

runtime_log = logging.getLogger(RUNTIME_LOGGER)


def plugin_logger(plugin: str) -> logging.Logger:
    """The logger of plugin ``plugin`` (``kunlun_infer.plugin.<plugin>``)."""
    return logging.getLogger(PLUGIN_LOGGER_PREFIX + plugin)


def call_traced(plugin: str, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call ``fn``; at DEBUG, log entry, exit (or error) and duration on the plugin's logger."""
    log = plugin_logger(plugin)
    if not log.isEnabledFor(logging.DEBUG):
        return fn(*args, **kwargs)
    log.debug("-> %s", what)
    start = time.perf_counter()
    try:
        result = fn(*args, **kwargs)
    except BaseException as exc:
        log.debug("<- %s raised %s after %.3f ms", what, type(exc).__name__, (time.perf_counter() - start) * 1e3)
        raise
    log.debug("<- %s (%.3f ms)", what, (time.perf_counter() - start) * 1e3)
    return result
