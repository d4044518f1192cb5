"""Observability hooks: pluggy calls them, and each observer runs isolated from the others.

The engine promises that a failing observer never stops a step. So when a
plugin is registered, each of its observability hook implementations is
replaced by one that calls it (traced at DEBUG), logs anything it raises —
naming the plugin and the hook — and returns ``None``. pluggy still makes the
calls, so ``tryfirst``/``trylast`` order them and wrappers (``wrapper=True``
or old-style ``hookwrapper=True``) surround the others; a wrapper that fails
before or after its ``yield`` is logged and skipped the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any

import pluggy

from kunlun_infer.runtime.log import call_traced, runtime_log

#: hooks whose implementations only watch the engine; their results are ignored
OBSERVER_HOOKS: tuple[str, ...] = ("kunlun_infer_engine_start", "kunlun_infer_engine_step",
                                   "kunlun_infer_request_finished", "kunlun_infer_engine_stop")


def _report(plugin: str, hook: str, exc: BaseException) -> None:
    runtime_log.error("plugin '%s' failed in %s (layer: observer), ignored: %s: %s", plugin, hook,
                      type(exc).__name__, " ".join(str(exc).split()))


def _isolated(plugin: str, hook: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> None:
        try:
            call_traced(plugin, hook, fn, *args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - an observer never stops the engine
            _report(plugin, hook, exc)

    return call


def _isolated_wrapper(plugin: str, hook: str, fn: Callable[..., Any], *, new_style: bool) -> Callable[..., Any]:
    """A wrapper that lets the inner calls happen even when ``fn`` fails around them."""

    def wrap(*args: Any, **kwargs: Any) -> Generator[None, Any, Any]:
        inner: Generator[None, Any, Any] | None = None
        try:
            inner = call_traced(plugin, hook, fn, *args, **kwargs)
            next(inner)
        except StopIteration:
            _report(plugin, hook, RuntimeError("the wrapper returned without yielding"))
            inner = None
        except Exception as exc:  # noqa: BLE001
            _report(plugin, hook, exc)
            inner = None
        outcome = yield
        if inner is not None:
            try:
                inner.send(outcome)
            except StopIteration as stop:
                return stop.value if new_style else None
            except Exception as exc:  # noqa: BLE001
                _report(plugin, hook, exc)
            else:
                inner.close()
                _report(plugin, hook, RuntimeError("the wrapper yielded more than once"))
        return outcome if new_style else None

    return wrap


def isolate_observers(pm: pluggy.PluginManager, registered_as: str, plugin: str) -> None:
    """Make every observability hook implementation of the plugin registered as ``registered_as`` isolated."""
    for hook in OBSERVER_HOOKS:
        for impl in getattr(pm.hook, hook).get_hookimpls():
            if impl.plugin_name != registered_as:
                continue
            if impl.wrapper or impl.hookwrapper:
                isolated = _isolated_wrapper(plugin, hook, impl.function, new_style=impl.wrapper)
            else:
                isolated = _isolated(plugin, hook, impl.function)
            impl.function = isolated  # type: ignore[misc]  # pluggy calls it with the original's arguments
