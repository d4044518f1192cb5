"""A fleet's config: the shipped examples compose, mistakes are named before anything starts, Ray is optional."""

from __future__ import annotations

import sys

import pytest

import kunlun_infer as ki
from kunlun_infer import ConfigError, KunlunInferError, compose_config
from kunlun_infer.fleet import replica_plan
from kunlun_infer.fleet.cluster import actor_options


def test_the_mixed_example_lists_gpu_and_kunlun_replicas_with_their_resources():
    plan = replica_plan(compose_config(["fleet=gpu_kunlun"]).fleet)
    assert set(plan) == {"gpu", "gpu-1", "kunlun"}  # count: 2 expands
    assert plan["kunlun"][1] == {"kunlun_xpu": 8.0} and "parallel.tensor_size=8" in plan["kunlun"][0]
    assert actor_options(plan["gpu"][1]) == {"num_cpus": 0, "num_gpus": 1.0}
    assert actor_options(plan["kunlun"][1]) == {"num_cpus": 0, "resources": {"kunlun_xpu": 8.0}}
    assert compose_config(["fleet=gpu_kunlun", "fleet.replicas.gpu.count=4"]).fleet.replicas.gpu.count == 4


def test_no_fleet_chosen_is_named():
    with pytest.raises(ConfigError, match="no fleet to run: choose one with fleet=<name>"):
        ki.Fleet()


@pytest.mark.parametrize("override, message", [
    ("fleet.replicas.cpu.overrides=['model.path=/elsewhere']", "every replica serves the fleet's model"),
    ("fleet.replicas.cpu.count=0", r"fleet.replicas.cpu.count=0 must be >= 1"),
    ("fleet.max_restarts=-2", r"fleet.max_restarts=-2 must be >= -1"),
])
def test_a_bad_replica_setting_is_refused_before_ray_starts(override, message, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # nothing may reach Ray
    with pytest.raises(ConfigError, match=message):
        ki.Fleet("cpu_simchip", overrides=[override])


def test_without_ray_the_fleet_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(KunlunInferError, match=r"Ray is not installed: pip install 'kunlun-infer\[cluster\]'"):
        ki.Fleet("cpu_simchip")


def test_a_resource_no_node_offers_is_refused_before_any_replica_starts(ray_cluster):
    address, _ = ray_cluster
    with pytest.raises(ConfigError, match=r"fleet.replicas.kunlun.resources: kunlun_xpu=8 is more than the Ray "
                                          r"cluster offers \(CPU=1, simchip=1\)"):
        ki.Fleet("gpu_kunlun", overrides=[f"fleet.address={address}", "~fleet.replicas.gpu"])
