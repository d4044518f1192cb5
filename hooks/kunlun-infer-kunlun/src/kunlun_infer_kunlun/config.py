"""The Hydra options of the Kunlun plugin.

``device=kunlun`` adds ``visible_devices`` (sets ``XPU_VISIBLE_DEVICES``
before the device runtime starts) and ``version_check`` (``warn``, ``error``
or ``off``: what a combination the observed deployments contradict does;
``warn`` by default, since the matrix is observation, not a vendor
guarantee). ``comm=bkcl`` adds the collective library's tuning knobs, each
exported as its variable before the process group is created, plus ``env``
for any other ``BKCL_``/``XCCL_``/``XSHMEM_`` variable.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional

from kunlun_infer.config import CommConfig, DeviceConfig, MemoryConfig, OpsConfig, PlatformConfig, StreamsConfig
from kunlun_infer.hookspecs import ConfigOption

DEVICE = "kunlun"
COMM = "bkcl"
VERSION_CHECK_MODES = ("warn", "error", "off")


@dataclasses.dataclass
class KunlunDeviceConfig(DeviceConfig):
    """``device=kunlun``: one XPU; ``index`` is relative to the visible devices (default: local rank)."""

    name: str = DEVICE
    #: comma-separated physical XPU ids, exported as XPU_VISIBLE_DEVICES; None = leave the env alone
    visible_devices: Optional[str] = None
    #: what a version-matrix mismatch does: warn | error | off
    version_check: str = "warn"


@dataclasses.dataclass
class BkclCommConfig(CommConfig):
    """``comm=bkcl``: collectives through BKCL/XCCL behind torch.distributed; None leaves a variable unset."""

    name: str = COMM
    #: BKCL_SOCKET_IFNAME: network interface for bootstrap traffic
    socket_ifname: Optional[str] = None
    #: BKCL_RDMA_NICS: RDMA NIC per device, comma-separated (see `xpu-smi topo -m`)
    rdma_nics: Optional[str] = None
    #: BKCL_ENABLE_XDR: cross-node RDMA
    enable_xdr: Optional[bool] = None
    #: BKCL_PCIE_RING: ring over PCIe within a node
    pcie_ring: Optional[bool] = None
    #: BKCL_RDMA_VERBS: RDMA verbs transport
    rdma_verbs: Optional[bool] = None
    #: BKCL_TRACE_TOPO: log the topology the library found
    trace_topo: Optional[bool] = None
    #: BKCL_TIMEOUT: the library's collective timeout, passed as given (deployments set e.g. 400000)
    timeout: Optional[int] = None
    #: BKCL_TREE_THRESHOLD: message size from which the tree algorithm is used (0 and 1 appear in guides)
    tree_threshold: Optional[int] = None
    #: BKCL_FORCE_L3_RDMA: RDMA buffers in L3; guides leave it 0 (1 runs out of memory when L3 is short)
    force_l3_rdma: Optional[bool] = None
    #: TORCH_NCCL_AVOID_RECORD_STREAMS: torch's NCCL-backend process group holds tensors until their collective
    #: ends instead of recording them on its stream, so the caching allocator reuses their memory sooner
    avoid_record_streams: Optional[bool] = True
    #: any further BKCL_* / XCCL_* / XSHMEM_* variables, exported as given
    env: Dict[str, str] = dataclasses.field(default_factory=dict)


def config_options() -> list[ConfigOption]:
    return [
        ConfigOption(group="device", name=DEVICE, node=KunlunDeviceConfig),
        ConfigOption(group="memory", name=DEVICE, node=MemoryConfig(name=DEVICE)),
        ConfigOption(group="ops", name=DEVICE, node=OpsConfig(name=DEVICE)),
        ConfigOption(group="streams", name=DEVICE, node=StreamsConfig(name=DEVICE)),
        ConfigOption(group="comm", name=COMM, node=BkclCommConfig),
        ConfigOption(group="platform", name=DEVICE,
                     node=PlatformConfig(name=DEVICE, device=DEVICE, memory=DEVICE, ops=DEVICE, comm=COMM,
                                         streams=DEVICE)),
    ]
