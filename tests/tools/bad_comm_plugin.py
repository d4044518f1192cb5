"""A test comm plugin ``badgather``: gloo collectives, but all_gather returns the ranks' parts in reverse."""

import torch

from kunlun_infer.hookspecs import PluginInfo, hookimpl
from kunlun_infer.plugins.cpu_comm import GlooComm


class ReversedGatherComm(GlooComm):
    name = "badgather"

    def all_gather(self, tensor, dim=-1):
        parts = super().all_gather(tensor, dim=dim).chunk(self.world_size, dim=dim)
        return torch.cat(parts[::-1], dim=dim)


@hookimpl
def kunlun_infer_plugin_info():
    return PluginInfo(name="bad-gather", version="0.0.3", api=">=1.0,<2", capabilities=("comm",))


@hookimpl
def kunlun_infer_comm_factories():
    return {"badgather": lambda *, config, device: ReversedGatherComm()}
