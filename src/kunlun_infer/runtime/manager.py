"""The plugin manager: finds plugins, checks them, and answers one typed question per hook.

A thin wrapper around pluggy. Built-in plugins are registered first; then the
entry points of group ``kunlun_infer`` are loaded one at a time. A plugin that
fails to import, to validate, to describe itself, or that supports another
hook-API version is recorded in :attr:`PluginManager.load_errors` and left out;
it becomes fatal only when a run chooses one of its options, or when strict
loading is on (``KUNLUN_INFER_STRICT_PLUGINS=1``). The describing hooks
(plugin info, factories, config options) are asked of each plugin on its own,
so every answer and every error is attributed to the plugin that gave it.
pluggy calls the observability hooks, each observer isolated from the others
(:mod:`kunlun_infer.runtime.observers`).

Env controls (comma-separated entry-point names): ``KUNLUN_INFER_PLUGINS``
loads only those; ``KUNLUN_INFER_DISABLE_PLUGINS`` skips those. Nothing is
cached across managers: a new manager always reflects the current environment.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os
from collections.abc import Callable, Mapping
from typing import Any

import pluggy

from kunlun_infer import hookspecs
from kunlun_infer.errors import PluginError
from kunlun_infer.hookspecs import CAPABILITIES, ConfigOption, PluginInfo
from kunlun_infer.plugins import BUILTIN_PLUGINS
from kunlun_infer.runtime.guard import guarded_call
from kunlun_infer.runtime.log import runtime_log
from kunlun_infer.runtime.observers import isolate_observers
from kunlun_infer.runtime.options import validate_config_option
from kunlun_infer.runtime.versions import check_api_range

ALLOW_ENV = "KUNLUN_INFER_PLUGINS"
BLOCK_ENV = "KUNLUN_INFER_DISABLE_PLUGINS"
STRICT_ENV = "KUNLUN_INFER_STRICT_PLUGINS"
#: factory hook of each capability, then of each engine extension (registered by name the same way)
FACTORY_HOOKS: dict[str, str] = {
    **{capability: f"kunlun_infer_{capability}_factories" for capability in CAPABILITIES},
    "logits_processor": "kunlun_infer_logits_processor_factories",
}


@dataclasses.dataclass
class LoadedPlugin:
    """A plugin that loaded: what it said about itself and what it registered."""

    name: str
    info: PluginInfo
    source: str  # "builtin", "entry point", or "api" (registered by code)
    entry_point: str | None = None
    distribution: str | None = None
    distribution_version: str | None = None
    #: capability (or extension, see ``FACTORY_HOOKS``) → {option name: factory}
    factories: dict[str, dict[str, Callable[..., Any]]] = dataclasses.field(default_factory=dict)
    config_options: list[ConfigOption] = dataclasses.field(default_factory=list)
    module: Any = None

    def options(self, capability: str) -> list[str]:
        """Names of the factories this plugin registered for ``capability``."""
        return sorted(self.factories.get(capability, {}))


@dataclasses.dataclass
class LoadError:
    """An entry point that could not be loaded, and why."""

    name: str
    entry_point: str
    distribution: str | None
    distribution_version: str | None
    error: PluginError

    @property
    def message(self) -> str:
        return str(self.error)


def _one_line(exc: BaseException) -> str:
    """``Type: message`` with the message's whitespace (newlines included) collapsed."""
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"


def _names_from_env(environ: Mapping[str, str], key: str) -> set[str] | None:
    raw = environ.get(key, "").strip()
    if not raw:
        return None
    return {name.strip() for name in raw.split(",") if name.strip()}


class PluginManager:
    """The plugins of one process, with one typed method per hook."""

    def __init__(self) -> None:
        self._pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self._pm.add_hookspecs(hookspecs)
        self.plugins: dict[str, LoadedPlugin] = {}
        self.load_errors: list[LoadError] = []
        #: entry points left out on purpose: ``(name, reason)``
        self.skipped: list[tuple[str, str]] = []
        self._factories: dict[str, dict[str, tuple[str, Callable[..., Any]]]] = {c: {} for c in FACTORY_HOOKS}

    # ------------------------------------------------------------------ loading

    @classmethod
    def load(cls, *, builtins: bool = True, entry_points: bool = True, strict: bool | None = None,
             environ: Mapping[str, str] | None = None) -> PluginManager:
        """A manager with the built-in plugins and the installed entry points (filtered by env)."""
        manager = cls()
        if builtins:
            for module in BUILTIN_PLUGINS:
                manager.register(module, source="builtin")
        if entry_points:
            manager.load_entry_points(strict=strict, environ=environ)
        return manager

    def load_entry_points(self, *, strict: bool | None = None, environ: Mapping[str, str] | None = None) -> None:
        """Load every entry point of group ``kunlun_infer`` that the env lists allow, one by one."""
        environ = os.environ if environ is None else environ
        if strict is None:
            strict = environ.get(STRICT_ENV, "").strip().lower() in ("1", "true", "yes")
        allowed, blocked = _names_from_env(environ, ALLOW_ENV), _names_from_env(environ, BLOCK_ENV) or set()
        seen: set[tuple[str, str]] = set()
        found: set[str] = set()
        for ep in importlib.metadata.entry_points(group=hookspecs.PROJECT_NAME):
            if (ep.name, ep.value) in seen:  # the same distribution visible twice on sys.path
                continue
            seen.add((ep.name, ep.value))
            found.add(ep.name)
            if allowed is not None and ep.name not in allowed:
                self.skipped.append((ep.name, f"not listed in {ALLOW_ENV}"))
                continue
            if ep.name in blocked:
                self.skipped.append((ep.name, f"listed in {BLOCK_ENV}"))
                continue
            self._load_entry_point(ep, strict=strict)
        for name in sorted((allowed or set()) - found):
            runtime_log.warning("%s names plugin '%s', but no entry point of that name is installed",
                                ALLOW_ENV, name)

    def _load_entry_point(self, ep: importlib.metadata.EntryPoint, *, strict: bool) -> None:
        dist = getattr(ep, "dist", None)
        dist_name = dist.name if dist is not None else None
        dist_version = dist.version if dist is not None else None
        runtime_log.debug("loading plugin entry point %s = %s (%s %s)", ep.name, ep.value, dist_name, dist_version)
        try:
            try:
                module = ep.load()
            except Exception as exc:
                raise PluginError(
                    f"plugin '{ep.name}' (entry point {ep.value}, distribution {dist_name} {dist_version}) "
                    f"failed to import: {_one_line(exc)}", plugin=ep.name, hook="import",
                    layer="plugin") from exc
            self.register(module, source="entry point", entry_point=ep.name,
                          distribution=dist_name, distribution_version=dist_version)
        except PluginError as error:
            if strict:
                raise
            runtime_log.warning("plugin '%s' not loaded: %s", ep.name, error)
            self.load_errors.append(LoadError(ep.name, ep.value, dist_name, dist_version, error))

    def register(self, plugin: Any, *, source: str = "api", entry_point: str | None = None,
                 distribution: str | None = None, distribution_version: str | None = None) -> LoadedPlugin:
        """Check and register one plugin object or module; all or nothing.

        Raises :class:`PluginError` (or :class:`PluginVersionError`) naming the
        plugin when it does not fit; nothing of it stays registered then.
        """
        label = entry_point or getattr(plugin, "__name__", type(plugin).__name__)
        reg_name = f"{source}:{label}" if source != "api" else f"api:{label}@{id(plugin):x}"
        try:
            self._pm.register(plugin, name=reg_name)
        except Exception as exc:
            raise PluginError(f"plugin '{label}' does not fit the hook specifications: {_one_line(exc)}",
                              plugin=label, hook="register", layer="plugin") from exc
        try:
            loaded = self._describe(plugin, reg_name, label, source=source, entry_point=entry_point,
                                    distribution=distribution, distribution_version=distribution_version)
        except BaseException:
            self._pm.unregister(name=reg_name)
            raise
        isolate_observers(self._pm, reg_name, loaded.name)
        self.plugins[loaded.name] = loaded
        for capability, factories in loaded.factories.items():
            for option, factory in factories.items():
                self._factories[capability][option] = (loaded.name, factory)
        runtime_log.debug("registered plugin '%s' %s (%s)", loaded.name, loaded.info.version, source)
        return loaded

    def _describe(self, plugin: Any, reg_name: str, label: str, **where: Any) -> LoadedPlugin:
        infos = self._call_one(reg_name, label, "kunlun_infer_plugin_info")
        if not infos:
            raise PluginError(f"plugin '{label}' does not implement kunlun_infer_plugin_info, which every "
                              f"plugin must", plugin=label, hook="kunlun_infer_plugin_info")
        info = infos[0]
        if not isinstance(info, PluginInfo):
            raise PluginError(f"plugin '{label}': kunlun_infer_plugin_info returned {type(info).__name__}, "
                              f"expected kunlun_infer.hookspecs.PluginInfo", plugin=label,
                              hook="kunlun_infer_plugin_info")
        name = info.name
        check_api_range(info.api, plugin=name, distribution=where["distribution"],
                        distribution_version=where["distribution_version"])
        if name in self.plugins:
            other = self.plugins[name]
            raise PluginError(f"plugin name '{name}' ({label}) is already taken by the plugin from "
                              f"{other.distribution or other.source}; rename one of them", plugin=name,
                              hook="kunlun_infer_plugin_info")
        loaded = LoadedPlugin(name=name, info=info, module=plugin, **where)
        for capability, hook in FACTORY_HOOKS.items():
            for result in self._call_one(reg_name, name, hook):
                if not isinstance(result, Mapping):
                    raise PluginError(f"plugin '{name}': {hook} returned {type(result).__name__}, expected a "
                                      f"mapping of name to factory", plugin=name, hook=hook)
                for option, factory in result.items():
                    self._check_new_factory(name, capability, option, factory, hook)
                    loaded.factories.setdefault(capability, {})[str(option)] = factory
        for result in self._call_one(reg_name, name, "kunlun_infer_config_options"):
            for option in result or ():
                loaded.config_options.append(validate_config_option(option, plugin=name, taken=self._options_taken()))
        return loaded

    def _check_new_factory(self, plugin: str, capability: str, option: Any, factory: Any, hook: str) -> None:
        if not isinstance(option, str) or not option or not callable(factory):
            raise PluginError(f"plugin '{plugin}': {hook} must map non-empty names to callables, got "
                              f"{option!r}: {factory!r}", plugin=plugin, hook=hook)
        if option in self._factories[capability]:
            owner = self._factories[capability][option][0]
            raise PluginError(f"plugin '{plugin}' registers {capability} option '{option}', which plugin "
                              f"'{owner}' already registers; uninstall or block one of them "
                              f"({BLOCK_ENV})", plugin=plugin, hook=hook)

    def _options_taken(self) -> set[tuple[str, str]]:
        return {(opt.group, opt.name) for p in self.plugins.values() for opt in p.config_options}

    def _call_one(self, reg_name: str, plugin: str, hook: str, **kwargs: Any) -> list[Any]:
        """Results of ``hook`` from the plugin registered as ``reg_name`` only."""
        results = []
        for impl in getattr(self._pm.hook, hook).get_hookimpls():
            if impl.plugin_name == reg_name:
                result = guarded_call(plugin, hook, impl.function, **{a: kwargs[a] for a in impl.argnames})
                if result is not None:
                    results.append(result)
        return results

    # ------------------------------------------------------------------ queries

    def options(self, capability: str) -> list[str]:
        """Registered option names for ``capability`` (``device`` → ``["cpu", …]``)."""
        return sorted(self._factories[capability])

    def factory(self, capability: str, option: str) -> tuple[str, Callable[..., Any]]:
        """``(plugin name, factory)`` registered as ``option`` for ``capability``.

        Raises :class:`PluginError` listing the available options; when a plugin
        failed to load, its error is named (and chained) since it may have been
        the one meant to provide ``option``.
        """
        if capability not in self._factories:
            raise PluginError(f"unknown capability '{capability}'; capabilities: {', '.join(FACTORY_HOOKS)}",
                              layer="runtime")
        if option in self._factories[capability]:
            return self._factories[capability][option]
        message = (f"no plugin provides {capability} '{option}'; available: "
                   f"{', '.join(self.options(capability)) or 'none'}")
        broken = self.load_error_for(option)
        if broken is not None:
            raise PluginError(f"{message}; plugin '{broken.name}' failed to load: {broken.message}",
                              plugin=broken.name, hook=broken.error.hook, layer="plugin") from broken.error
        if self.load_errors:
            message += "; plugins that failed to load: " + ", ".join(e.name for e in self.load_errors)
        raise PluginError(message, hook=capability, layer="runtime")

    def load_error_for(self, option: str) -> LoadError | None:
        """The load error of the entry point named ``option``, if that one failed."""
        return next((e for e in self.load_errors if e.name == option), None)

    def plugin_for(self, capability: str, option: str) -> LoadedPlugin:
        """The loaded plugin that provides ``option`` of ``capability``."""
        return self.plugins[self.factory(capability, option)[0]]

    def config_options(self) -> list[tuple[str, ConfigOption]]:
        """``(plugin name, option)`` for every Hydra option the plugins contribute."""
        return [(p.name, opt) for p in self.plugins.values() for opt in p.config_options]

    # ------------------------------------------------------------------ observability hooks
    # pluggy calls every observer; each is isolated, so none of these ever raises for an observer's failure

    def engine_start(self, info: Mapping[str, Any]) -> None:
        """Tell observers the engine is ready (``kunlun_infer_engine_start``)."""
        self._pm.hook.kunlun_infer_engine_start(info=info)

    def engine_step(self, stats: Mapping[str, Any]) -> None:
        """Tell observers a step finished (``kunlun_infer_engine_step``)."""
        self._pm.hook.kunlun_infer_engine_step(stats=stats)

    def request_finished(self, output: Any) -> None:
        """Tell observers a request finished (``kunlun_infer_request_finished``)."""
        self._pm.hook.kunlun_infer_request_finished(output=output)

    def engine_stop(self, stats: Mapping[str, Any]) -> None:
        """Tell observers the engine stops (``kunlun_infer_engine_stop``)."""
        self._pm.hook.kunlun_infer_engine_stop(stats=stats)

    def has_observers(self, hook: str) -> bool:
        """True when any plugin implements ``hook`` (lets the engine skip building stats)."""
        return bool(getattr(self._pm.hook, hook).get_hookimpls())

    def describe(self) -> list[dict[str, Any]]:
        """The version matrix: one dict per loaded plugin, then one per load error."""
        rows: list[dict[str, Any]] = []
        for p in self.plugins.values():
            rows.append({
                "name": p.name, "version": p.info.version, "source": p.source, "entry_point": p.entry_point,
                "distribution": p.distribution, "distribution_version": p.distribution_version,
                "api": p.info.api, "capabilities": list(p.info.capabilities),
                "options": {c: p.options(c) for c in FACTORY_HOOKS if p.options(c)},
                "config_options": sorted(f"{o.group}={o.name}" for o in p.config_options),
                "stack": dict(p.info.stack), "description": p.info.description, "error": None,
            })
        for e in self.load_errors:
            rows.append({
                "name": e.name, "version": None, "source": "entry point", "entry_point": e.name,
                "distribution": e.distribution, "distribution_version": e.distribution_version,
                "api": None, "capabilities": [], "options": {}, "config_options": [], "stack": {},
                "description": "", "error": e.message,
            })
        return rows
