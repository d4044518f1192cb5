"""Test devices that fail stage 1: ``unreachable`` cannot open, ``nowhere`` names a torch device that holds no data."""

import torch

from kunlun_infer.hookspecs import PluginInfo, hookimpl
from kunlun_infer.plugins.cpu_device import CpuDevice


class UnreachableDevice(CpuDevice):
    name = "unreachable"

    def open(self):
        raise RuntimeError("no device found at /dev/fake0")


class NowhereDevice(CpuDevice):
    name = "nowhere"

    @property
    def torch_device(self):
        return torch.device("meta")  # tensors sent there never come back


@hookimpl
def kunlun_infer_plugin_info():
    return PluginInfo(name="broken-devices", version="0.0.4", api=">=1.0,<2", capabilities=("device",))


@hookimpl
def kunlun_infer_device_factories():
    return {"unreachable": lambda *, config, local_rank=0: UnreachableDevice(index=local_rank),
            "nowhere": lambda *, config, local_rank=0: NowhereDevice(index=local_rank)}
