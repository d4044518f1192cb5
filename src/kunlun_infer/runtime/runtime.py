"""The runtime: one device composed from the capability plugins the config chose.

``Runtime.from_config(cfg)`` looks up each capability's factory by the
registered name in ``cfg.<capability>.name``, builds the device (and opens
it), then memory, ops, comm (not yet joined to a group) and streams for that
device. Every object is wrapped in a guard, so anything a plugin raises
surfaces as a :class:`PluginError` naming plugin, method and layer. The
engine receives the runtime; nothing reaches for a global device.
"""

from __future__ import annotations

import inspect
import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any

from omegaconf import DictConfig

from kunlun_infer.capabilities import Comm, Device, MemoryAllocator, OpsProvider, Streams
from kunlun_infer.config import setting
from kunlun_infer.errors import ConfigError, PluginError
from kunlun_infer.hookspecs import CAPABILITIES
from kunlun_infer.ops.attention import AttentionBackend, AttentionSpec
from kunlun_infer.runtime.attention import plugin_attention_backend
from kunlun_infer.runtime.config_checks import refuse_targets
from kunlun_infer.runtime.guard import guard, guarded_call, unwrap
from kunlun_infer.runtime.log import runtime_log
from kunlun_infer.runtime.manager import PluginManager
from kunlun_infer.runtime.optable import OpTable, resolve

INTERFACES: dict[str, type] = {"device": Device, "memory": MemoryAllocator, "ops": OpsProvider,
                               "comm": Comm, "streams": Streams}


def _accepts(factory: Callable[..., Any], name: str) -> bool:
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


class Runtime:
    """The capabilities of one process: ``device``, ``memory``, ``ops``, ``comm``, ``streams``."""

    def __init__(self, *, config: DictConfig, plugins: PluginManager, objects: dict[str, Any],
                 providers: dict[str, str], local_rank: int = 0) -> None:
        self.config = config
        self.plugins = plugins
        self.local_rank = local_rank
        # each capability is the plugin's object behind its guard
        self.device: Device = objects["device"]
        self.memory: MemoryAllocator = objects["memory"]
        #: the ops plugin's provider (use :meth:`resolve_ops` for kernels)
        self.ops: OpsProvider = objects["ops"]
        self.comm: Comm = objects["comm"]
        self.streams: Streams = objects["streams"]
        self._providers = providers  # capability → plugin name
        self._warned_fallbacks: set[str] = set()
        self._announced_backends: set[AttentionSpec] = set()
        self._closed = False
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_config(cls, cfg: DictConfig, *, local_rank: int = 0,
                    plugin_manager: PluginManager | None = None) -> Runtime:
        """Build the runtime the config describes; the device is opened, comm not yet initialised."""
        refuse_targets(cfg)  # a config built by hand never went through composition's checks
        manager = plugin_manager if plugin_manager is not None else PluginManager.load()
        objects: dict[str, Any] = {}
        providers: dict[str, str] = {}
        try:
            for capability in CAPABILITIES:
                node = cfg.get(capability)
                if node is None or node.get("name") is None:
                    raise ConfigError(f"{capability}.name is not set; choose an option, e.g. "
                                      f"{capability}={(manager.options(capability) or ['<name>'])[0]}")
                plugin, factory = manager.factory(capability, str(node.name))
                kwargs: dict[str, Any] = {"config": node}
                if capability == "device":
                    if _accepts(factory, "local_rank"):
                        kwargs["local_rank"] = local_rank
                else:
                    kwargs["device"] = unwrap(objects["device"])
                made = guarded_call(plugin, f"{capability} factory '{node.name}'", factory, **kwargs)
                objects[capability] = guard(made, plugin=plugin, capability=capability,
                                            interface=INTERFACES[capability])
                providers[capability] = plugin
                if capability == "device":
                    try:
                        objects["device"].open()
                    except BaseException:
                        del objects["device"]  # never opened: nothing to close
                        raise
        except BaseException:
            _close_partial(objects)
            raise
        runtime_log.info("runtime ready: %s", ", ".join(f"{c}={cfg[c].name} ({providers[c]})" for c in CAPABILITIES))
        return cls(config=cfg, plugins=manager, objects=objects, providers=providers, local_rank=local_rank)

    # ------------------------------------------------------------------ capabilities

    def plugin_for(self, capability: str) -> str:
        """Name of the plugin providing ``capability`` in this runtime."""
        if capability not in self._providers:
            raise KeyError(f"unknown capability '{capability}'; capabilities: {', '.join(CAPABILITIES)}")
        return self._providers[capability]

    def init_comm(self, *, rank: int, world_size: int, init_method: str | None = None,
                  timeout_s: float | None = None) -> None:
        """Join the comm group (``comm.init``); ``timeout_s`` defaults to ``comm.timeout_s``."""
        if timeout_s is None:
            timeout_s = float(setting(self.config, "comm.timeout_s"))
        self.comm.init(rank=rank, world_size=world_size, init_method=init_method, timeout_s=timeout_s)

    # ------------------------------------------------------------------ ops

    def resolve_ops(self, ops: Iterable[str]) -> OpTable:
        """Resolve ``ops`` against the ops plugin; reference fallbacks are logged once and counted.

        :raises OpsCoverageError: with ``ops.strict=true`` and ops missing, or for
            an op neither the plugin nor the reference table provides.
        """
        strict = bool(setting(self.config, "ops.strict"))
        table = resolve(ops, provider=unwrap(self.ops), plugin=self._providers["ops"], strict=strict)
        new = [op for op in table.fallbacks if op not in self._warned_fallbacks]
        if new:
            self._warned_fallbacks.update(new)
            runtime_log.warning("ops plugin '%s' lacks %d op(s), using the plain-torch reference: %s "
                                "(set ops.strict=true to refuse)", self._providers["ops"], len(new), ", ".join(new))
        return table

    def optional_ops(self, ops: Iterable[str]) -> OpTable:
        """Ops the engine calls around the model (``greedy_tokens``, hook API 1.8): the plugin's where it has
        them, else the references, and never refused under ``ops.strict``: a plugin written before they were in
        the op table cannot have them, and runs as it did."""
        table = resolve(ops, provider=unwrap(self.ops), plugin=self._providers["ops"], strict=False)
        if table.fallbacks:
            runtime_log.info("ops plugin '%s' has no %s: the plain-torch reference serves", self._providers["ops"],
                             ", ".join(table.fallbacks))
        return table

    def attention_backend(self, spec: AttentionSpec) -> AttentionBackend | None:
        """The ops plugin's attention backend for ``spec`` (guarded), or ``None`` when the reference serves."""
        backend = plugin_attention_backend(unwrap(self.ops), self._providers["ops"], spec)
        if backend is not None and spec not in self._announced_backends:
            self._announced_backends.add(spec)
            runtime_log.info("ops plugin '%s' serves attention with its backend '%s'", self._providers["ops"],
                             backend.name)
        return backend

    def capture_step(self, fn: Callable[[], Any]) -> Any:
        """``fn`` captured by the ops plugin for replay (``OpsProvider.capture``, hook API 1.5), or ``None``
        where it does not capture (a provider written before 1.5 never does)."""
        plugin = self._providers["ops"]
        method = getattr(unwrap(self.ops), "capture", None)
        if method is None:
            return None
        captured = guarded_call(plugin, "ops.capture", method, fn)
        if captured is not None and not callable(getattr(captured, "replay", None)):
            raise PluginError(f"plugin '{plugin}': ops.capture returned a {type(captured).__name__}, which has no "
                              f"replay()", plugin=plugin, hook="ops.capture")
        return captured

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Close streams, destroy comm if initialised, empty the memory cache, close the device.

        Idempotent. Every step runs even if an earlier one fails; the first
        failure is raised afterwards.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        steps: list[tuple[str, Callable[[], Any]]] = [("streams.close", self.streams.close)]
        if self.comm.joined:
            steps.append(("comm.destroy", self.comm.destroy))
        steps += [("memory.empty_cache", self.memory.empty_cache), ("device.close", self.device.close)]
        first: BaseException | None = None
        for what, step in steps:
            try:
                step()
            except Exception as exc:  # noqa: BLE001 - keep releasing, report the first failure
                runtime_log.log(logging.ERROR if first is None else logging.WARNING, "%s failed: %s", what, exc)
                first = first or exc
        if first is not None:
            raise first

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        chosen = ", ".join(f"{c}={self.config[c].name}" for c in CAPABILITIES)
        return f"<Runtime {chosen}{' closed' if self._closed else ''}>"


def _close_partial(objects: dict[str, Any]) -> None:
    """Release what a failed ``from_config`` already built, without masking its error."""
    for capability, close in (("streams", "close"), ("memory", "empty_cache"), ("device", "close")):
        if capability in objects:
            try:
                getattr(objects[capability], close)()
            except Exception as exc:  # noqa: BLE001
                runtime_log.warning("cleanup %s.%s failed: %s", capability, close, exc)


__all__ = ["PluginError", "Runtime"]
