"""``compose_config``: build the run's config from ``conf/``, plugin options and overrides.

Uses Hydra's composition machinery directly, never ``hydra.main`` nor the
global Hydra instance: no ``outputs/`` folder, no change of working directory,
no logging set-up, and it works inside an application that itself runs under
``@hydra.main``. The root schema and the plugins' options are put into Hydra's
config store only for the duration of one composition (under a lock) and
removed again, so nothing leaks from one composition into the next.

Hydra's own config (launcher, sweeper, logging, output folders), which the
result leaves out anyway, is not composed: a bare ``hydra`` node stands in for
it. A composition is kept, keyed by its overrides and the plugins' options,
and the same request again gets a copy of it: a process that builds several
engines, or one again, composes once (about 0.25 s on a 2-core Zen 3 where the
copy takes 4 ms).
"""

from __future__ import annotations

import collections
import copy
import threading
from collections.abc import Sequence
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from kunlun_infer.config import GROUP_SCHEMAS, KunlunConfig, check_ranges
from kunlun_infer.errors import ConfigError
from kunlun_infer.runtime.config_checks import check_composed, refuse_target_overrides, translate_error
from kunlun_infer.runtime.log import runtime_log
from kunlun_infer.hookspecs import CAPABILITIES, ConfigOption
from kunlun_infer.runtime.manager import PluginManager
from kunlun_infer.runtime.options import (CONF_PACKAGE, PLATFORM_GROUP, PLATFORM_PACKAGE, option_node,
                                          packaged_options, platform_node)

#: name under which the root schema is stored; first entry of ``conf/config.yaml``'s defaults
SCHEMA_NAME = "_kunlun_schema"
_STORE_LOCK = threading.Lock()
#: compositions kept (the most recently asked for), keyed by overrides and the plugins' options
COMPOSED_KEPT = 32
_COMPOSED: collections.OrderedDict[tuple, DictConfig] = collections.OrderedDict()


def _loader() -> Any:
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra._internal.config_search_path_impl import ConfigSearchPathImpl
    from hydra.core.plugins import Plugins

    Plugins.instance()  # registers Hydra's config sources (pkg://, file://, structured://)
    search_path = ConfigSearchPathImpl()  # no pkg://hydra.conf: _bare_hydra_node stands in for Hydra's own config
    search_path.append("main", f"pkg://{CONF_PACKAGE}")
    search_path.append("schema", "structured://")
    return ConfigLoaderImpl(config_search_path=search_path)


class _StoredEntries:
    """Put entries into Hydra's config store and restore whatever was there before."""

    def __init__(self) -> None:
        self._saved: list[tuple[dict[str, Any], str, Any]] = []
        self._created_groups: list[str] = []

    def store(self, *, name: str, node: Any, group: str | None = None, provider: str = "kunlun_infer",
              package: str | None = None) -> None:
        repo = ConfigStore.instance().repo
        if group is not None and group not in repo:
            self._created_groups.append(group)
        key = f"{name}.yaml"
        previous = (repo if group is None else repo.get(group, {})).get(key)
        ConfigStore.instance().store(name=name, node=node, group=group, provider=provider, package=package)
        self._saved.append((repo if group is None else repo[group], key, previous))

    def restore(self) -> None:
        repo = ConfigStore.instance().repo
        for folder, key, previous in reversed(self._saved):
            if previous is None:
                folder.pop(key, None)
            else:
                folder[key] = previous
        for group in self._created_groups:
            if not repo.get(group):
                repo.pop(group, None)


def compose_config(overrides: Sequence[str] = (), *, plugin_manager: Any = None) -> DictConfig:
    """Compose the config of a run.

    :param overrides: Hydra overrides (``["device=cpu", "scheduler.max_num_seqs=8"]``).
    :param plugin_manager: a :class:`~kunlun_infer.runtime.PluginManager`
        whose plugins' options join the groups; by default one is loaded.
    :return: a struct-mode ``DictConfig`` typed by :class:`kunlun_infer.config.KunlunConfig`
        (an unknown key or a badly typed value is refused, also on later assignment).
    :raises ConfigError: one line naming the group, key or value at fault.
    """
    overrides = [str(o) for o in overrides]
    refuse_target_overrides(overrides)
    manager = plugin_manager if plugin_manager is not None else PluginManager.load()
    options = _options(manager)
    key = (tuple(overrides), tuple((plugin, o.group, o.name, repr(o.node)) for plugin, o in options))
    with _STORE_LOCK:
        composed = _COMPOSED.get(key)
        if composed is not None:
            _COMPOSED.move_to_end(key)
    if composed is None:
        composed = _compose(overrides, options, manager)
        with _STORE_LOCK:
            _COMPOSED[key] = composed
            while len(_COMPOSED) > COMPOSED_KEPT:
                _COMPOSED.popitem(last=False)
    runtime_log.debug("composed config with overrides %s", overrides)
    return copy.deepcopy(composed)


def _compose(overrides: list[str], options: list[tuple[str, ConfigOption]], manager: Any) -> DictConfig:
    """What :func:`compose_config` returns, composed by Hydra and checked."""
    with _STORE_LOCK:
        stored = _StoredEntries()
        try:
            stored.store(name=SCHEMA_NAME, node=KunlunConfig)
            stored.store(group="hydra", name="config", node=_bare_hydra_node(), provider="kunlun_infer")
            for plugin, option in options:
                platform = option.group == PLATFORM_GROUP
                stored.store(group=option.group, name=option.name,
                             node=platform_node(option) if platform else option_node(option),
                             package=PLATFORM_PACKAGE if platform else None, provider=f"kunlun_infer plugin {plugin}")
            cfg = _loader().load_configuration(config_name="config", overrides=overrides, run_mode=_run_mode())
        except (HydraException, OmegaConfBaseException) as exc:
            raise translate_error(exc, overrides, manager) from exc
        finally:
            stored.restore()
    with open_dict(cfg):
        del cfg["hydra"]
    check_composed(cfg)
    check_ranges(cfg)
    OmegaConf.set_readonly(cfg, False)
    OmegaConf.set_struct(cfg, True)
    return cfg


def _bare_hydra_node() -> Any:
    """Hydra's config schema without its defaults list (output folders, launcher, sweeper, logging, help): the
    fields Hydra's loader fills in after composing, and nothing more, where the full config cost a composition
    ~45% of its time. The result drops the ``hydra`` node."""
    from hydra.conf import HydraConf

    return HydraConf(defaults=[])


def _options(manager: Any) -> list[tuple[str, ConfigOption]]:
    """The plugins' own options, plus a plain one for each factory that brought none.

    A plugin that registers ``memory`` factory ``mypool`` without contributing
    a config option still composes as ``memory=mypool`` (with the group's
    schema and no keys of its own).
    """
    options = list(manager.config_options())
    have = {(o.group, o.name) for _, o in options}
    for capability in CAPABILITIES:
        packaged = set(packaged_options(capability))
        for name in manager.options(capability):
            if (capability, name) not in have and name not in packaged:
                plugin = manager.factory(capability, name)[0]
                options.append((plugin, ConfigOption(capability, name, GROUP_SCHEMAS[capability](name=name))))
    return options


def _run_mode() -> Any:
    from hydra.types import RunMode

    return RunMode.RUN


__all__ = ["ConfigError", "SCHEMA_NAME", "compose_config"]
