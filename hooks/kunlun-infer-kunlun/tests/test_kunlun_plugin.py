"""Registration, config, BKCL tuning variables — and a clear refusal on this host, which has no Kunlun stack."""

import logging

import pytest
import torch

from kunlun_infer.errors import ConfigError, PluginError
from kunlun_infer.runtime import PluginManager, Runtime, compose_config

from kunlun_infer_kunlun.tuning import export_tuning, tuning_env

KUNLUN_RUN = ["device=kunlun", "memory=kunlun", "ops=kunlun", "streams=kunlun", "comm=bkcl"]


@pytest.fixture(scope="module")
def manager():
    return PluginManager.load()


def test_entry_point_registers_kunlun_and_bkcl(manager):
    plugin = manager.plugins["kunlun"]
    assert plugin.distribution == "kunlun-infer-kunlun"
    assert plugin.options("comm") == ["bkcl"] and plugin.options("device") == ["kunlun"]
    # read from the installed distributions: "not installed" here, versions on a Kunlun host
    assert {"torch", "xpytorch", "kunlun_ops", "xspeedgate_ops", "cocopod"} <= set(plugin.info.stack)


def test_tuning_options_become_bkcl_variables(manager):
    cfg = compose_config([*KUNLUN_RUN, "comm.enable_xdr=true", "comm.pcie_ring=false", "comm.rdma_nics='mlx5_1,mlx5_2'",
                          "+comm.env.BKCL_TIMEOUT=600"], plugin_manager=manager)
    assert tuning_env(cfg.comm) == {"BKCL_RDMA_NICS": "mlx5_1,mlx5_2", "BKCL_ENABLE_XDR": "1",
                                    "BKCL_PCIE_RING": "0", "TORCH_NCCL_AVOID_RECORD_STREAMS": "1",
                                    "BKCL_TIMEOUT": "600"}


def test_only_collective_library_variables_pass_through(manager):
    cfg = compose_config([*KUNLUN_RUN, "+comm.env.LD_PRELOAD=/tmp/x.so"], plugin_manager=manager)
    with pytest.raises(ConfigError, match="comm.env.LD_PRELOAD"):
        tuning_env(cfg.comm)


def test_config_wins_over_the_environment_and_says_so(caplog):
    environ = {"BKCL_PCIE_RING": "1", "BKCL_OTHER": "kept"}
    with caplog.at_level(logging.WARNING, logger="kunlun_infer.plugin.kunlun"):
        export_tuning({"BKCL_PCIE_RING": "0"}, environ)
    assert environ == {"BKCL_PCIE_RING": "0", "BKCL_OTHER": "kept"}
    assert "BKCL_PCIE_RING=0 (the environment had 1)" in caplog.text


def test_device_config_is_typed(manager):
    cfg = compose_config([*KUNLUN_RUN, "device.visible_devices='0,1'", "device.version_check=warn"],
                         plugin_manager=manager)
    assert cfg.device.visible_devices == "0,1" and cfg.device.version_check == "warn"


def test_runtime_on_this_host_refuses_naming_what_is_missing(manager):
    cfg = compose_config([*KUNLUN_RUN, "device.visible_devices=null"], plugin_manager=manager)
    with pytest.raises(PluginError) as info:
        Runtime.from_config(cfg, plugin_manager=manager)
    assert info.value.plugin == "kunlun" and info.value.layer == "hardware"
    assert "/dev/xpuctrl does not exist" in str(info.value) and "torch_xmlir is not importable" in str(info.value)
