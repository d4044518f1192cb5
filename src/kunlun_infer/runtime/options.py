"""Config options: the ones shipped in ``conf/`` and the ones plugins contribute.

A plugin option is a dataclass subclassing its group's schema from
:mod:`kunlun_infer.config`; it is checked here at load so a malformed option is
the plugin's load error, not a composition failure later.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
from typing import Any

from omegaconf import DictConfig, OmegaConf

from kunlun_infer.config import GROUP_SCHEMAS
from kunlun_infer.errors import PluginError
from kunlun_infer.hookspecs import CAPABILITIES, ConfigOption

CONF_PACKAGE = "kunlun_infer.conf"


def packaged_options(group: str) -> list[str]:
    """Option names of ``group`` shipped as YAML files in ``conf/``."""
    folder = importlib.resources.files(CONF_PACKAGE) / group
    if not folder.is_dir():
        return []
    return sorted(entry.name[: -len(".yaml")] for entry in folder.iterdir() if entry.name.endswith(".yaml"))


#: the group whose options choose one option in each capability group
PLATFORM_GROUP = "platform"
#: Hydra package of a platform option: it sets the capability groups, at the root of the config
PLATFORM_PACKAGE = "_global_"


def option_node(option: ConfigOption) -> DictConfig:
    """The typed OmegaConf node of a (validated) plugin option."""
    node = OmegaConf.structured(option.node)
    if (option.group in CAPABILITIES or option.group == PLATFORM_GROUP) and OmegaConf.is_missing(node, "name"):
        node.name = option.name
    return node


def platform_node(option: ConfigOption) -> DictConfig:
    """What Hydra stores for a platform option: a defaults list choosing each capability, and the platform's name.

    Stored under :data:`PLATFORM_PACKAGE`, exactly like ``conf/platform/cpu.yaml``.
    """
    node = option_node(option)
    choices = [{f"/{capability}": str(node[capability])} for capability in CAPABILITIES]
    return OmegaConf.create({"defaults": [*choices, "_self_"], PLATFORM_GROUP: {"name": option.name}})


def validate_config_option(option: Any, *, plugin: str, taken: set[tuple[str, str]]) -> ConfigOption:
    """Check a contributed option; raise :class:`PluginError` naming the plugin when it is malformed."""
    hook = "kunlun_infer_config_options"

    def refuse(why: str) -> PluginError:
        return PluginError(f"plugin '{plugin}' contributes a bad config option: {why}", plugin=plugin, hook=hook)

    if not isinstance(option, ConfigOption):
        raise refuse(f"{option!r} is not a kunlun_infer.hookspecs.ConfigOption")
    where = f"{option.group}={option.name}"
    if option.group not in GROUP_SCHEMAS:
        raise refuse(f"{where}: unknown group '{option.group}'; groups: {', '.join(GROUP_SCHEMAS)}")
    if not option.name or option.name.startswith("_") or "/" in option.name:
        raise refuse(f"{where}: option names must be non-empty, without '/', not starting with '_'")
    schema = GROUP_SCHEMAS[option.group]
    node_type = option.node if isinstance(option.node, type) else type(option.node)
    if not (dataclasses.is_dataclass(node_type) and issubclass(node_type, schema)):
        raise refuse(f"{where}: node must be a dataclass subclassing kunlun_infer.config.{schema.__name__}, "
                     f"got {node_type.__name__}")
    if option.name in packaged_options(option.group) or (option.group, option.name) in taken:
        raise refuse(f"{where}: that option already exists; choose another name")
    try:
        node = option_node(option)
    except Exception as exc:
        raise refuse(f"{where}: {type(exc).__name__}: {exc}") from exc
    if (option.group in CAPABILITIES or option.group == PLATFORM_GROUP) and node.name != option.name:
        raise refuse(f"{where}: its 'name' field is '{node.name}' but must equal the option name "
                     f"'{option.name}' (the registered factory name)")
    if option.group == PLATFORM_GROUP:
        unset = [c for c in CAPABILITIES if OmegaConf.is_missing(node, c) or not str(node[c]).strip()]
        if unset:
            raise refuse(f"{where}: a platform names an option for every capability; missing: {', '.join(unset)}")
    if "_target_" in node:
        raise refuse(f"{where}: configs never carry '_target_'; implementations are found by registered name")
    return option
