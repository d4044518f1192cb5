"""Built-in CPU reference plugins, registered by the framework itself.

Each module is one plugin (with its own :class:`~kunlun_infer.hookspecs.PluginInfo`):
``cpu`` device, ``cpu-memory`` (``caching``, ``simple``), ``torch-ops``
(``torch``), ``cpu-comm`` (``single``, ``gloo``) and ``cpu-streams`` (``sync``).
They are the reference every other plugin is measured against. ``xgrammar``
registers the built-in logits processor of structured output (its library is
an optional dependency, imported only when a structured request arrives).
"""

from kunlun_infer.plugins import cpu_comm, cpu_device, cpu_memory, cpu_streams, torch_ops, xgrammar_processor

BUILTIN_PLUGINS = (cpu_device, cpu_memory, torch_ops, cpu_comm, cpu_streams, xgrammar_processor)

__all__ = ["BUILTIN_PLUGINS"]
