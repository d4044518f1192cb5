"""The runtime: plugin discovery and checks, config composition, and the composed capabilities.

``compose_config`` builds a run's config; ``PluginManager`` finds and checks
plugins; ``Runtime.from_config`` composes one device from the chosen plugins;
``Runtime.resolve_ops`` gives the model its :class:`OpTable`.
"""

from kunlun_infer.runtime.compose import compose_config
from kunlun_infer.runtime.guard import unwrap
from kunlun_infer.runtime.manager import LoadedPlugin, LoadError, PluginManager
from kunlun_infer.runtime.optable import OpTable
from kunlun_infer.runtime.runtime import Runtime

__all__ = ["LoadError", "LoadedPlugin", "OpTable", "PluginManager", "Runtime", "compose_config", "unwrap"]
