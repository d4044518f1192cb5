"""One Ray cluster of two nodes on this machine, shared by the fleet tests (and stopped after them), and the tiny chat model they serve.

The head node offers one logical CPU; the second node, a raylet process of
its own, offers ``{simchip: 1}`` and nothing else, so a replica asking for
``simchip`` can only run there: placement by resource is real. Both listen on
127.0.0.1 only (Ray keeps every address on loopback with its single-machine
switch) and are stopped after the last fleet test, also when a test fails;
Ray's reaper process stops them if this process dies.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

from tests.chat_models import build_chat_model
from tests.engine.tiny_models import engine_overrides
from tests.server.harness import ServedApp

for _module, _extra in (("ray", "cluster"), ("kunlun_infer_simchip", "hooks/kunlun-infer-simchip")):
    if importlib.util.find_spec(_module) is None:
        pytest.skip(f"{_module} is not installed: pip install -e '.[test]' and the plugins under hooks/",
                    allow_module_level=True)

SIMCHIP = ["device=simchip", "memory=simchip", "ops=simchip", "streams=simchip"]
#: the fleet of the issue (conf/fleet/cpu_simchip.yaml): the host CPU, and the simulated chip with a small arena,
#: which only a node offering {simchip: 1} can run
PAIR = ["fleet=cpu_simchip",
        "fleet.replicas.simchip.overrides=[" + ",".join(f"'{o}'" for o in (*SIMCHIP, "device.capacity=256MiB")) + "]"]


def fleet_engine_overrides(**keys) -> list[str]:
    """Small engines, float32 on both devices (so greedy tokens agree exactly), one torch thread each."""
    return engine_overrides(model__dtype="float32", scheduler__max_num_seqs=16, cache__num_blocks=256, **keys)


@pytest.fixture(scope="package")
def ray_cluster():
    """``(gcs address, id of the simchip node)`` of the two-node loopback cluster."""
    saved = {key: os.environ.get(key) for key in ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_USAGE_STATS_ENABLED")}
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # Ray's single-machine switch: node addresses on 127.0.0.1
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    import ray
    from ray._private import ray_constants
    from ray.cluster_utils import Cluster

    flag, ray_constants.ENABLE_RAY_CLUSTER = ray_constants.ENABLE_RAY_CLUSTER, False
    small = dict(include_dashboard=False, object_store_memory=80 * 2**20, num_gpus=0)
    cluster = Cluster(initialize_head=True, head_node_args=dict(num_cpus=1, **small))
    try:
        second = cluster.add_node(num_cpus=0, resources={"simchip": 1}, object_store_memory=80 * 2**20)
        yield cluster.address, second.node_id
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.shutdown()
        ray_constants.ENABLE_RAY_CLUSTER = flag
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture(scope="package")
def chat_model(tmp_path_factory):
    return build_chat_model(tmp_path_factory.mktemp("fleet-model"))


class FleetServer(ServedApp):
    """``fleet.app()``, served (see :class:`tests.server.harness.ServedApp`)."""

    def __init__(self, fleet) -> None:
        self.fleet = fleet
        super().__init__(fleet.app())
