"""Detection and the version matrix, with a fake xpu-smi and a fake torch_xmlir."""

import pytest
from kunlun_fakes import SMI_OUTPUT, fake_importer, fake_run, torch_xmlir_module

from kunlun_infer_kunlun.detect import StackProbe, collective_version, detect, parse_smi
from kunlun_infer_kunlun.matrix import MATRIX, PairRule, check_matrix, in_range, version_tuple


def test_xpu_smi_versions_and_device_table_are_parsed():
    report = parse_smi(SMI_OUTPUT)
    assert (report.driver, report.runtime) == ("5.0.21", "5.0.21")
    assert [d["id"] for d in report.devices] == [0, 1, 2]
    assert report.devices[1] == {"id": 1, "model": "P800", "memory_used_mb": 1024, "memory_total_mb": 98304,
                                 "pci": "0000:07:00.0"}


def test_older_xpu_smi_layout_parses_too():
    text = "Runtime Version: 4.0\nDriver Version: 4.0\n| DevID | PCI Addr | Model | Memory |\n" \
           "|     0 | 0000:06:00.0 | R200  | 504 / 8064 MB |\n"
    report = parse_smi(text)
    assert report.driver == "4.0" and report.devices == [
        {"id": 0, "model": "R200", "memory_used_mb": 504, "memory_total_mb": 8064, "pci": "0000:06:00.0"}]


def test_detect_on_a_full_stack():
    probe = StackProbe(run=fake_run({"xpu-smi": SMI_OUTPUT}),
                       import_module=fake_importer({"torch_xmlir": torch_xmlir_module()}), environ={})
    found = detect(probe)
    assert found.usable and found.problems == []
    assert found.versions == {"driver": "5.0.21", "runtime": "5.0.21", "bkcl": "2.3.1", "torch_xmlir": "2.1.0"}


def test_detect_falls_back_to_the_old_tool_name():
    run = fake_run({"xpu_smi": SMI_OUTPUT})
    found = detect(StackProbe(run=run, import_module=fake_importer({}), environ={}))
    assert [c[0] for c in run.calls] == ["xpu-smi", "xpu_smi"] and found.versions["driver"] == "5.0.21"


def test_detect_on_a_bare_host_records_what_is_missing():
    found = detect(StackProbe(run=fake_run({}), import_module=fake_importer({}), environ={}))
    assert not found.usable
    assert any("xpu-smi did not run" in p for p in found.problems)
    assert any("torch_xmlir is not importable" in p and "xpytorch" in p for p in found.problems)
    assert set(found.versions.values()) == {None}


def test_collective_version_from_a_versioned_library_file(tmp_path):
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libbkcl.so.2.4.0").write_bytes(b"")
    (tmp_path / "lib" / "libother.so.9").write_bytes(b"")
    module = torch_xmlir_module(bkcl=None, file=str(tmp_path / "__init__.py"))
    assert collective_version(module) == "2.4.0"


@pytest.mark.parametrize("text,parts", [("5.0.21.26", (5, 0, 21, 26)), ("2.1.0+xpu", (2, 1, 0)), ("v3.2", (3, 2))])
def test_version_tuples(text, parts):
    assert version_tuple(text) == parts


def test_ranges():
    assert in_range("5.0.21", ">=5.0,<6")
    assert not in_range("4.0.3", ">=5.0")
    assert in_range("2.0", ">=2.0.0")  # shorter versions are padded with zeros
    with pytest.raises(ValueError, match="malformed"):
        in_range("1.0", "about 1")


def test_a_matching_stack_passes_the_shipped_matrix():
    result = check_matrix({"driver": "5.0.21", "runtime": "5.0.21", "bkcl": "2.3.1", "torch_xmlir": "2.1.0",
                           "kunlun-infer-kunlun": "0.1.0"})
    assert result.ok and result.unchecked == []


def test_a_mismatch_names_the_pair_and_both_versions():
    result = check_matrix({"driver": "4.0.3", "runtime": "5.0.21", "bkcl": "2.3.1", "torch_xmlir": "2.1.0",
                           "kunlun-infer-kunlun": "0.1.0"})
    assert not result.ok
    assert any(m.startswith("torch_xmlir 2.1.0 needs driver >=5.0, found driver 4.0.3") for m in result.mismatches)
    assert any(m.startswith("runtime 5.0.21 needs driver >=5.0, found driver 4.0.3") for m in result.mismatches)


def test_plugin_against_an_old_torch_xmlir_is_named():
    result = check_matrix({"torch_xmlir": "1.9.0", "kunlun-infer-kunlun": "0.1.0"})
    assert result.mismatches == [
        "kunlun-infer-kunlun 0.1.0 needs torch_xmlir >=2.0, found torch_xmlir 1.9.0 (the plugin uses the CUDA-API "
        "device and the nccl process-group backend of torch_xmlir 2.x)"]


def test_unknown_versions_are_reported_unchecked_not_guessed():
    result = check_matrix({"torch_xmlir": "2.1.0", "kunlun-infer-kunlun": "0.1.0", "driver": None})
    assert result.ok
    assert any("unknown: driver" in u for u in result.unchecked)
    assert len(result.unchecked) == len(MATRIX) - 1


def test_custom_rules():
    rules = (PairRule("bkcl", ">=3", "runtime", ">=6"),)
    assert check_matrix({"bkcl": "3.1", "runtime": "5.9"}, rules).mismatches == [
        "bkcl 3.1 needs runtime >=6, found runtime 5.9"]
    assert check_matrix({"bkcl": "2.9", "runtime": "5.9"}, rules).ok  # the rule does not apply
