"""Source code of small outside plugins, installed by tests as temporary distributions; and a plugin object
that contributes config options, for a test to register by code."""

import types


def options_plugin(*options) -> types.SimpleNamespace:
    """A plugin ("boardmaker") whose only contribution is ``options`` (:class:`ConfigOption`)."""
    from kunlun_infer.hookspecs import PluginInfo, hookimpl

    @hookimpl
    def kunlun_infer_plugin_info():
        return PluginInfo(name="boardmaker", version="1.0", api=">=1.0,<2")

    @hookimpl
    def kunlun_infer_config_options():
        return list(options)

    return types.SimpleNamespace(kunlun_infer_plugin_info=kunlun_infer_plugin_info,
                                 kunlun_infer_config_options=kunlun_infer_config_options)


COUNTING_MEMORY = '''
import dataclasses

import torch

from kunlun_infer.capabilities import MemoryAllocator, MemoryStats
from kunlun_infer.config import MemoryConfig
from kunlun_infer.errors import DeviceOutOfMemoryError
from kunlun_infer.hookspecs import ConfigOption, PluginInfo, hookimpl

CALLS = []


@dataclasses.dataclass
class CountingConfig(MemoryConfig):
    name: str = "counting"
    limit_bytes: int = 1 << 20


class CountingAllocator(MemoryAllocator):
    name = "counting"

    def __init__(self, device, limit_bytes):
        self.device, self.limit, self.live = device, limit_bytes, {}

    def allocate(self, shape, dtype):
        t = torch.empty(tuple(shape), dtype=dtype, device=self.device.torch_device)
        size = self.round_size(t.numel() * t.element_size())
        used = sum(self.live.values())
        if used + size > self.limit:
            raise DeviceOutOfMemoryError("counting pool exhausted", requested=size, free=self.limit - used,
                                         capacity=self.limit)
        self.live[t.data_ptr()] = size
        CALLS.append(("allocate", tuple(shape), dtype))
        return t

    def free(self, tensor):
        CALLS.append(("free", tuple(tensor.shape), tensor.dtype))
        del self.live[tensor.data_ptr()]

    def stats(self):
        used = sum(self.live.values())
        return MemoryStats(allocated=used, reserved=used, peak=used, fragmentation=0.0)


@hookimpl
def kunlun_infer_plugin_info():
    return PluginInfo(name="counting", version="1.2.3", api=">=1.0,<2", capabilities=("memory",),
                      stack={"counting-driver": "9.9"})


@hookimpl
def kunlun_infer_memory_factories():
    return {"counting": lambda *, config, device: CountingAllocator(device, config.limit_bytes)}


@hookimpl
def kunlun_infer_config_options():
    return [ConfigOption(group="memory", name="counting", node=CountingConfig)]
'''

FUTURE_API = '''
from kunlun_infer.hookspecs import PluginInfo, hookimpl


@hookimpl
def kunlun_infer_plugin_info():
    return PluginInfo(name="future", version="7.0.0", api=">=2.0,<3", capabilities=("device",))


@hookimpl
def kunlun_infer_device_factories():
    raise AssertionError("never called: the plugin is refused first")
'''

BROKEN_IMPORT = '''
raise ImportError("libchip.so: cannot open shared object file")
'''

DUPLICATE_CACHING = '''
from kunlun_infer.hookspecs import PluginInfo, hookimpl


@hookimpl
def kunlun_infer_plugin_info():
    return PluginInfo(name="copycat", version="0.1", capabilities=("memory",))


@hookimpl
def kunlun_infer_memory_factories():
    return {"caching": lambda *, config, device: None}
'''

FAILING_HOOK = '''
from kunlun_infer.hookspecs import PluginInfo, hookimpl


@hookimpl
def kunlun_infer_plugin_info():
    return PluginInfo(name="faulty", version="0.1", capabilities=("ops",))


@hookimpl
def kunlun_infer_ops_factories():
    raise RuntimeError("driver table not initialised")
'''
