"""Opening a Kunlun device with fakes: visible devices, stack detection, the version check's three modes."""

import logging

import pytest
from kunlun_fakes import SMI_OUTPUT, FakeCudaApi, fake_importer, fake_run, torch_xmlir_module

from kunlun_infer.errors import ConfigError, PluginError

from kunlun_infer_kunlun.detect import StackProbe
from kunlun_infer_kunlun.device import KunlunDevice


def make_device(index=0, *, smi=SMI_OUTPUT, xmlir="2.1.0", environ=None, modules=None, **kwargs):
    environ = {} if environ is None else environ
    stack = {"torch_xmlir": torch_xmlir_module(version=xmlir)} if xmlir else {}
    probe = StackProbe(run=fake_run({"xpu-smi": smi} if smi else {}), import_module=fake_importer(stack),
                       environ=environ)
    return KunlunDevice(index=index, probe=probe, api=FakeCudaApi(), environ=environ,
                        modules={} if modules is None else modules, **kwargs)


def test_opens_on_a_matching_stack_and_knows_its_card():
    device = make_device(1)
    device.open()
    facts = device.identity()
    assert device.is_open and device.api.current == 1
    assert facts["physical_id"] == 1 and facts["xpu_smi"]["model"] == "P800" and facts["vendor"] == "Kunlunxin"
    versions = device.stack_versions()
    assert versions["driver"] == "5.0.21" and versions["torch_xmlir"] == "2.1.0" and versions["bkcl"] == "2.3.1"
    device.close()


def test_visible_devices_are_exported_and_indices_are_relative_to_them():
    environ = {}
    device = make_device(1, environ=environ, visible_devices="2,0")
    device.open()
    assert environ["XPU_VISIBLE_DEVICES"] == "2,0"
    assert device.physical_id == 0 and device.api.current == 1
    device.close()


def test_inherited_visible_devices_limit_the_ranks():
    with pytest.raises(PluginError, match=r"device.index=2 but XPU_VISIBLE_DEVICES makes only 2 XPU\(s\) visible"):
        make_device(2, environ={"XPU_VISIBLE_DEVICES": "0,1"}).open()


def test_visible_devices_after_the_stack_started_are_refused():
    device = make_device(0, environ={"XPU_VISIBLE_DEVICES": "0,1"}, visible_devices="3",
                         modules={"torch_xmlir": object()})
    with pytest.raises(PluginError, match="torch_xmlir is already imported"):
        device.open()


def test_malformed_visible_devices_are_named():
    with pytest.raises(PluginError, match="not a comma-separated list of XPU ids"):
        make_device(0, environ={"XPU_VISIBLE_DEVICES": "xpu0"}).open()


def test_without_torch_xmlir_the_error_says_what_to_install():
    device = make_device(0, xmlir=None)
    with pytest.raises(PluginError) as info:
        device.open()
    assert info.value.layer == "hardware" and "torch_xmlir is not importable" in str(info.value)
    assert not device.is_open


def test_version_mismatch_is_refused_naming_the_pair():
    old_driver = SMI_OUTPUT.replace("Driver Version: 5.0.21", "Driver Version: 4.0.3")
    device = make_device(0, smi=old_driver)
    with pytest.raises(PluginError) as info:
        device.open()
    text = str(info.value)
    assert "torch_xmlir 2.1.0 needs driver >=5.0, found driver 4.0.3" in text
    assert "device.version_check=warn" in text and info.value.layer == "hardware"


def test_version_check_warn_logs_and_opens(caplog):
    old_xmlir = make_device(0, xmlir="1.9.0", version_check="warn")
    with caplog.at_level(logging.WARNING, logger="kunlun_infer.plugin.kunlun"):
        old_xmlir.open()
    assert old_xmlir.is_open
    assert "kunlun-infer-kunlun 0.1.0 needs torch_xmlir >=2.0, found torch_xmlir 1.9.0" in caplog.text
    old_xmlir.close()


def test_version_check_off_skips_the_matrix():
    device = make_device(0, xmlir="1.0", version_check="off")
    device.open()
    assert device.is_open
    device.close()


def test_bad_version_check_mode_is_a_config_error():
    with pytest.raises(ConfigError, match="device.version_check='sometimes'"):
        make_device(0, version_check="sometimes")
