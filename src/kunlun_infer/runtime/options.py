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


def option_node(option: ConfigOption) -> DictConfig:
    """The typed OmegaConf node of a (validated) plugin option."""
    node = OmegaConf.structured(option.node)
    if option.group in CAPABILITIES and OmegaConf.is_missing(node, "name"):
        node.name = option.name
    return node


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
    if option.group in CAPABILITIES and node.name != option.name:
        raise refuse(f"{where}: its 'name' field is '{node.name}' but must equal the option name "
                     f"'{option.name}' (the registered factory name)")
    if "_target_" in node:
        raise refuse(f"{where}: configs never carry '_target_'; implementations are found by registered name")
    return option
