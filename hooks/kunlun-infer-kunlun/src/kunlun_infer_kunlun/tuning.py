"""Collective-library tuning: ``comm=bkcl`` options exported as ``BKCL_*`` (and torch's NCCL-backend) variables.

BKCL reads its settings from the environment when a communicator is created,
and torch's NCCL-backend process group reads ``TORCH_NCCL_AVOID_RECORD_STREAMS``
when it is built, so they are exported just before the process group is. A value the
config sets wins over one already in the environment (logged, since that is
the surprising case); options left at None leave the environment alone.
Booleans are exported as ``1``/``0``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, MutableMapping
from typing import Any

from kunlun_infer.errors import ConfigError

log = logging.getLogger("kunlun_infer.plugin.kunlun")

#: config key -> environment variable
TUNING_VARIABLES = {
    "socket_ifname": "BKCL_SOCKET_IFNAME",
    "rdma_nics": "BKCL_RDMA_NICS",
    "enable_xdr": "BKCL_ENABLE_XDR",
    "pcie_ring": "BKCL_PCIE_RING",
    "rdma_verbs": "BKCL_RDMA_VERBS",
    "trace_topo": "BKCL_TRACE_TOPO",
    "timeout": "BKCL_TIMEOUT",
    "tree_threshold": "BKCL_TREE_THRESHOLD",
    "force_l3_rdma": "BKCL_FORCE_L3_RDMA",
    "avoid_record_streams": "TORCH_NCCL_AVOID_RECORD_STREAMS",
}
ALLOWED_PREFIXES = ("BKCL_", "XCCL_", "XSHMEM_")


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)


def tuning_env(config: Any) -> dict[str, str]:
    """The variables ``config`` (the composed ``comm`` node) asks for."""
    get = config.get if hasattr(config, "get") else (lambda k, d=None: getattr(config, k, d))
    env = {var: _text(get(key)) for key, var in TUNING_VARIABLES.items() if get(key) is not None}
    for key, value in dict(get("env") or {}).items():
        if not str(key).startswith(ALLOWED_PREFIXES):
            raise ConfigError(f"comm.env.{key}: only {', '.join(p + '*' for p in ALLOWED_PREFIXES)} variables may "
                              f"be set through comm=bkcl")
        env[str(key)] = _text(value)
    return env


def export_tuning(env: Mapping[str, str], environ: MutableMapping[str, str]) -> None:
    """Put ``env`` into ``environ``, noting values that replace different ones."""
    for key, value in env.items():
        previous = environ.get(key)
        if previous is not None and previous != value:
            log.warning("comm=bkcl sets %s=%s (the environment had %s)", key, value, previous)
        environ[key] = value
