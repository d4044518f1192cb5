"""The Ray cluster a fleet runs on: the one at ``fleet.address``, or one started on this machine.

Ray is an optional dependency (the ``cluster`` extra): it is imported when a
fleet starts, and its absence is one line saying how to install it. A
cluster the fleet starts itself offers ``fleet.num_cpus``,
``fleet.num_gpus`` and ``fleet.resources``, runs without a dashboard and
listens on 127.0.0.1 only; it stops when the fleet closes. A process that
already called ``ray.init`` keeps its own connection.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Mapping
from typing import Any

from kunlun_infer.errors import ConfigError, KunlunInferError

log = logging.getLogger("kunlun_infer.framework")

#: Ray's two predefined resources, which it takes as counts rather than in ``resources``
RAY_COUNTED = {"CPU": "num_cpus", "GPU": "num_gpus"}
#: the environment switch with which Ray keeps a node's address (and so every port it binds) on the loopback
#: interface: Ray's setting for platforms without multi-node clusters
_RAY_SINGLE_MACHINE = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
_LOOPBACK = ("127.0.0.1", "localhost")


def import_ray() -> Any:
    """The ``ray`` module, or a :class:`KunlunInferError` saying how to install it."""
    try:
        import ray
    except ImportError:
        raise KunlunInferError("a fleet runs its replicas as Ray actors, and Ray is not installed: "
                               "pip install 'kunlun-infer[cluster]'") from None
    return ray


@contextlib.contextmanager
def _loopback_only(ray: Any) -> Iterator[None]:
    """While Ray starts or joins a cluster on this machine, it keeps every address on 127.0.0.1."""
    from ray._private import ray_constants

    saved_env, saved_flag = os.environ.get(_RAY_SINGLE_MACHINE), ray_constants.ENABLE_RAY_CLUSTER
    os.environ[_RAY_SINGLE_MACHINE] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved_flag
        if saved_env is None:
            os.environ.pop(_RAY_SINGLE_MACHINE, None)
        else:
            os.environ[_RAY_SINGLE_MACHINE] = saved_env


def actor_options(resources: Mapping[str, float]) -> dict[str, Any]:
    """Ray actor options reserving ``resources`` (nothing named reserves nothing, not Ray's default CPU)."""
    options: dict[str, Any] = {"num_cpus": 0}
    custom = {}
    for key, amount in resources.items():
        if key in RAY_COUNTED:
            options[RAY_COUNTED[key]] = float(amount)
        else:
            custom[str(key)] = float(amount)
    if custom:
        options["resources"] = custom
    return options


class RayCluster:
    """A connection to the fleet's Ray cluster; :meth:`close` stops what this object started."""

    def __init__(self, fleet: Any) -> None:
        self.ray = ray = import_ray()
        self.owned = False
        if ray.is_initialized():
            return
        address = fleet.address
        host = str(address).rsplit(":", 1)[0] if address else None
        loopback = address is None or host in _LOOPBACK
        options: dict[str, Any] = dict(logging_level=logging.WARNING, configure_logging=False,
                                       namespace="kunlun_infer")
        if address is None:
            options.update(num_cpus=fleet.num_cpus, num_gpus=fleet.num_gpus, include_dashboard=False,
                           resources=dict(fleet.resources) or None)
        with _loopback_only(ray) if loopback else contextlib.nullcontext():
            try:
                ray.init(address=address or "local", **options)  # "local": never another cluster found here
            except ConnectionError as exc:
                raise ConfigError(f"fleet.address={address}: no Ray cluster answers there ({exc}); start one "
                                  f"with `ray start --head` or leave fleet.address unset for a local one") from None
        self.owned = True
        log.info("fleet on Ray cluster %s", ray.get_runtime_context().gcs_address)

    def check_resources(self, demands: Mapping[str, Mapping[str, float]]) -> None:
        """Refuse a replica needing a resource no node of the cluster offers enough of, before anything starts."""
        offered = self.ray.cluster_resources()
        for name, resources in demands.items():
            for key, amount in resources.items():
                if offered.get(key, 0) < float(amount):
                    have = ", ".join(f"{k}={v:g}" for k, v in sorted(offered.items())
                                     if not k.startswith(("node:", "memory", "object_store")))
                    raise ConfigError(
                        f"fleet.replicas.{name}.resources: {key}={amount:g} is more than the Ray cluster offers "
                        f"({have or 'nothing'}); add a node offering it (ray start --resources='{{\"{key}\": "
                        f"{amount:g}}}'), or for a cluster the fleet starts, fleet.resources / fleet.num_cpus / "
                        f"fleet.num_gpus")

    def close(self) -> None:
        if self.owned:
            self.owned = False
            self.ray.shutdown()
