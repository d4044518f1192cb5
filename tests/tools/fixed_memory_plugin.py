"""A test device ``fixedmem``: the CPU, reporting a fixed 64 MiB of device memory, all of it free.

Memory plans and the engine then see the same device memory on every run,
so their KV block counts can be compared exactly.
"""

from kunlun_infer.hookspecs import PluginInfo, hookimpl
from kunlun_infer.plugins.cpu_device import CpuDevice

CAPACITY = 64 * 2**20


class FixedMemoryDevice(CpuDevice):
    name = "fixedmem"

    def mem_get_info(self):
        return CAPACITY, CAPACITY


@hookimpl
def kunlun_infer_plugin_info():
    return PluginInfo(name="fixed-memory", version="0.0.1", api=">=1.0,<2", capabilities=("device",))


@hookimpl
def kunlun_infer_device_factories():
    return {"fixedmem": lambda *, config, local_rank=0: FixedMemoryDevice(index=local_rank)}
