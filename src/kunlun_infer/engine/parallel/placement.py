"""Where this process stands in a tensor-parallel run, and the config it implies.

A run is either *embedded* (the engine in the caller's process is rank 0 and
starts the other ranks itself) or *launched by torchrun* (every rank is a
process torchrun started, on one host or several; ``RANK``, ``WORLD_SIZE`` and
``LOCAL_RANK`` say which). :func:`resolve_parallel_config` settles
``parallel.tensor_size`` and the comm option before any plugin is built.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import socket
from collections.abc import Mapping

from omegaconf import DictConfig, OmegaConf, open_dict

from kunlun_infer.config import check_ranges
from kunlun_infer.errors import ConfigError

log = logging.getLogger("kunlun_infer.framework")

#: the comm option that cannot join processes, and the portable one used instead
SINGLE_PROCESS_COMM = "single"
PORTABLE_COMM = "gloo"


@dataclasses.dataclass(frozen=True)
class Place:
    """This process's rank among ``world_size`` processes, and its device index on its host."""

    rank: int
    world_size: int
    local_rank: int


def torchrun_place(environ: Mapping[str, str] | None = None) -> Place | None:
    """The place torchrun gave this process, or ``None`` when torchrun did not start it."""
    env = os.environ if environ is None else environ
    if "TORCHELASTIC_RUN_ID" not in env and "MASTER_ADDR" not in env:
        return None
    try:
        rank, world_size = int(env["RANK"]), int(env["WORLD_SIZE"])
        local_rank = int(env.get("LOCAL_RANK", rank))
    except (KeyError, ValueError):
        return None
    return Place(rank, world_size, local_rank)


def local_rank() -> int:
    """This process's device index on its host: torchrun's ``LOCAL_RANK``, else 0."""
    place = torchrun_place()
    return place.local_rank if place is not None else 0


def resolve_parallel_config(cfg: DictConfig, place: Place | None = None) -> DictConfig:
    """``cfg`` with ``parallel.tensor_size`` and ``comm`` fit for the process layout (a copy if changed).

    Under torchrun the world size is ``pipeline_size × tensor_size``
    (``parallel.tensor_size=1``, the default, means "all the ranks of a
    stage"). With more than one rank, ``comm=single``
    is replaced by ``comm=gloo``, torch.distributed's portable backend; a
    device's own comm plugin (chosen with ``comm=<name>``) is faster.
    """
    place = place if place is not None else torchrun_place()
    check_ranges(cfg)
    size = int(cfg.parallel.tensor_size)
    stages = int(cfg.parallel.get("pipeline_size", 1))
    changes: dict[str, object] = {}
    if place is not None and place.world_size > 1:
        if size * stages != place.world_size and (size != 1 or place.world_size % stages):
            raise ConfigError(f"parallel.pipeline_size={stages} × parallel.tensor_size={size} does not match the "
                              f"{place.world_size} processes torchrun started; leave parallel.tensor_size out or "
                              f"make the product {place.world_size}")
        if size * stages != place.world_size:
            changes["parallel.tensor_size"] = size = place.world_size // stages
    if size * stages > 1 and str(cfg.comm.name) == SINGLE_PROCESS_COMM:
        log.info("comm=%s serves one process; %d ranks use comm=%s", SINGLE_PROCESS_COMM, size * stages,
                 PORTABLE_COMM)
        changes["comm.name"] = PORTABLE_COMM
    if not changes:
        return cfg
    cfg = copy.deepcopy(cfg)
    with open_dict(cfg):
        for key, value in changes.items():
            OmegaConf.update(cfg, key, value, merge=False)
    return cfg


def free_loopback_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for the rendezvous of spawned ranks)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
