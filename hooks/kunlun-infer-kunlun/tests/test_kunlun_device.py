"""Opening a Kunlun device on a fake host: visible devices, the runtime-started check, the environment guard,
identity from xpu-smi (never the CUDA-compatibility layer), the version check's three modes."""

import logging

import pytest
from kunlun_fakes import (SGLANG_KUNLUN_DISTS, SMI_QUERY, VLLM_KUNLUN_DISTS, FakeCudaApi, fake_importer, fake_run,
                          fake_versions, kunlun_root, torch_xmlir_module)

from kunlun_infer.errors import ConfigError, PluginError

from kunlun_infer_kunlun.detect import StackProbe
from kunlun_infer_kunlun.device import KunlunDevice

LOGGER = "kunlun_infer.plugin.kunlun"


@pytest.fixture
def root(tmp_path):
    return kunlun_root(tmp_path)


def make_device(root, index=0, *, smi=None, dists=VLLM_KUNLUN_DISTS, xmlir=True, environ=None, api=None, **kwargs):
    environ = {} if environ is None else environ
    smi = {f"xpu-smi -i {i} -q": SMI_QUERY for i in range(8)} if smi is None else smi
    probe = StackProbe(run=fake_run(smi), import_module=fake_importer({"torch_xmlir": torch_xmlir_module()} if xmlir
                                                                      else {}),
                       environ=environ, version_of=fake_versions(dists), root=root)
    return KunlunDevice(index=index, probe=probe, api=api or FakeCudaApi(), environ=environ, **kwargs)


def test_opens_and_its_identity_comes_from_xpu_smi_not_the_compatibility_layer(root):
    device = make_device(root, 1)
    device.open()
    try:
        facts = device.identity()
        assert device.api.current == 1 and facts["physical_id"] == 1
        assert facts["model"] == "P800 OAM" and facts["architecture"] == "KL3" and facts["source"] == "xpu-smi"
        assert facts["total_memory"] == 98304 * 2**20 and facts["vendor"] == "Kunlunxin"
        assert "capability" not in facts and not {"GPU", "8.6"} & {str(v) for v in facts.values()}
        versions = device.stack_versions()
        assert versions["driver"] == "5.0.21.26" and versions["runtime"] == "5.0.21"
        assert versions["kunlun_ops"] == "0.1.58+ee39020a" and "xccl" not in versions
    finally:
        device.close()


def test_without_an_xpu_smi_report_identity_comes_from_the_stacks_own_properties(root):
    device = make_device(root, 0, smi={})
    device.open()
    try:
        facts = device.identity()
        assert facts["model"] == "P800" and facts["source"] == "torch_xmlir.xpu.get_device_properties"
        assert "capability" not in facts
    finally:
        device.close()


def test_visible_devices_are_exported_to_both_variables_and_indices_are_relative(root):
    environ = {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    device = make_device(root, 1, environ=environ, visible_devices="2,0")
    device.open()
    assert environ["XPU_VISIBLE_DEVICES"] == "2,0" and environ["CUDA_VISIBLE_DEVICES"] == "2,0"
    assert device.physical_id == 0 and device.api.current == 1
    assert device.probe.run.calls[0] == ["xpu-smi", "-i", "0", "-q"]
    device.close()


def test_inherited_visible_devices_limit_the_ranks(root):
    with pytest.raises(PluginError, match=r"device.index=2 but XPU_VISIBLE_DEVICES makes only 2 XPU\(s\) visible"):
        make_device(root, 2, environ={"XPU_VISIBLE_DEVICES": "0,1"}).open()


def test_an_imported_stack_does_not_block_visible_devices_but_a_started_runtime_does(root):
    environ = {"XPU_VISIBLE_DEVICES": "0,1"}
    make_device(root, 0, environ=environ, visible_devices="3").open()  # torch_xmlir imports itself with torch
    assert environ["XPU_VISIBLE_DEVICES"] == "3"
    started = make_device(root, 0, environ={"XPU_VISIBLE_DEVICES": "0,1"}, visible_devices="3",
                          api=FakeCudaApi(initialised=True))
    with pytest.raises(PluginError, match="the device runtime has started already"):
        started.open()
    same = make_device(root, 0, environ={"XPU_VISIBLE_DEVICES": "3"}, visible_devices="3",
                       api=FakeCudaApi(initialised=True))
    same.open()  # asking for what is already in effect is fine
    same.close()


def test_malformed_visible_devices_are_named(root):
    with pytest.raises(PluginError, match="not a comma-separated list of XPU ids"):
        make_device(root, 0, environ={"XPU_VISIBLE_DEVICES": "xpu0"}).open()


@pytest.mark.parametrize("environ,needle", [
    ({"XPU_DUMMY_EVENT": "1"}, "XPU_DUMMY_EVENT='1' is set"),
    ({"XMLIR_DISABLE_CUDA_ALLOCATOR": "true"}, "XMLIR_DISABLE_CUDA_ALLOCATOR='true'"),
    ({"CUDA_VISIBLE_DEVICES": "0,1", "XPU_VISIBLE_DEVICES": "2,3"}, "CUDA_VISIBLE_DEVICES='0,1' differs from"),
    ({"CUDA_VISIBLE_DEVICES": "0,1"}, "differs from XPU_VISIBLE_DEVICES=None"),
])
def test_the_environment_guard_warns_about_settings_that_break_the_plugin(root, caplog, environ, needle):
    device = make_device(root, 0, environ=dict(environ))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        device.open()
    device.close()
    assert needle in caplog.text and len(device.environment_warnings) == 1


def test_a_clean_environment_gives_no_warning(root, caplog):
    device = make_device(root, 0, environ={"XPU_VISIBLE_DEVICES": "0,1", "CUDA_VISIBLE_DEVICES": " 0, 1",
                                           "XMLIR_DISABLE_CUDA_ALLOCATOR": "false"})
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        device.open()
    device.close()
    assert device.environment_warnings == [] and caplog.text == ""


def test_without_the_control_node_the_error_says_so(tmp_path):
    device = make_device(tmp_path, 0)
    with pytest.raises(PluginError) as info:
        device.open()
    assert info.value.layer == "hardware" and "dev/xpuctrl does not exist" in str(info.value)
    assert not device.is_open


def test_without_the_xpytorch_build_the_error_says_what_to_install(root):
    device = make_device(root, 0, xmlir=False)
    with pytest.raises(PluginError) as info:
        device.open()
    assert "torch_xmlir is not importable" in str(info.value) and "xpytorch" in str(info.value)


def test_an_unseen_combination_warns_by_default_and_opens(root, caplog):
    device = make_device(root, 0, dists={**SGLANG_KUNLUN_DISTS, "xspeedgate_ops": "1.1.0+53992ca"})
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        device.open()
    assert device.is_open
    assert "torch 2.9.0 needs xspeedgate_ops +torch29, found xspeedgate_ops 1.1.0+53992ca" in caplog.text
    assert "observed in vendor deployments" in caplog.text
    device.close()


def test_version_check_error_refuses_naming_the_pair(root):
    device = make_device(root, 0, dists={**VLLM_KUNLUN_DISTS, "kunlun_ops": "0.1.40"}, version_check="error")
    with pytest.raises(PluginError) as info:
        device.open()
    assert "torch 2.5.1 needs kunlun_ops >=0.1.58, found kunlun_ops 0.1.40" in str(info.value)
    assert "device.version_check=warn" in str(info.value) and info.value.layer == "hardware"


def test_version_check_off_skips_the_matrix(root, caplog):
    device = make_device(root, 0, dists={**VLLM_KUNLUN_DISTS, "kunlun_ops": "0.1.40"}, version_check="off")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        device.open()
    assert device.is_open and caplog.text == ""
    device.close()


def test_bad_version_check_mode_is_a_config_error(root):
    with pytest.raises(ConfigError, match="device.version_check='sometimes'"):
        make_device(root, 0, version_check="sometimes")
