"""Detection and the version matrix against a fake host: /dev/xpuctrl, xpu-smi, installed distributions."""

import types

import pytest
from kunlun_fakes import (SGLANG_KUNLUN_DISTS, SMI_QUERY, SMI_TABLE, VLLM_KUNLUN_DISTS, fake_importer, fake_run,
                          fake_versions, kunlun_root, torch_xmlir_module)

from kunlun_infer_kunlun.detect import UNREADABLE, StackProbe, detect, parse_smi_query, parse_smi_table
from kunlun_infer_kunlun.matrix import MATRIX, OBSERVED, PairRule, check_matrix, in_range, version_tuple


def probe_for(root, smi=None, dists=VLLM_KUNLUN_DISTS, modules=None):
    modules = {"torch_xmlir": torch_xmlir_module()} if modules is None else modules
    return StackProbe(run=fake_run(smi or {}), import_module=fake_importer(modules), environ={},
                      version_of=fake_versions(dists), root=root)


def test_the_query_report_gives_both_versions_and_the_card():
    report = parse_smi_query(SMI_QUERY)
    assert (report.driver, report.runtime) == ("5.0.21.26", "5.0.21")
    assert report.card == {"model": "P800 OAM", "architecture": "KL3", "serial": "02K00Q0000000002",
                           "uuid": "GPU-00000000-0000-0000-0000-000000000002", "pci": "00000000:07:00.0",
                           "minor": "1", "memory_total_mb": 98304, "memory_used_mb": 1024}


def test_the_runtime_is_the_xpu_rt_line_not_an_invented_label():
    invented = SMI_QUERY.replace("XPU-RT Version", "Runtime Version")
    assert parse_smi_query(invented).runtime is None
    assert parse_smi_query(SMI_QUERY.replace(": 5.0.21\n", ": N/A\n", 1)).runtime is None


def test_the_table_header_and_row_when_the_query_is_refused():
    report = parse_smi_table(SMI_TABLE, physical_id=1)
    assert (report.driver, report.runtime) == ("5.0.21.26", "5.0.21")
    assert report.card == {"model": "P800 OAM", "pci": "00000000:07:00.0", "memory_used_mb": 1024,
                           "memory_total_mb": 98304}


def test_detection_queries_the_physical_card_and_reads_versions_from_metadata(tmp_path):
    probe = probe_for(kunlun_root(tmp_path), {"xpu-smi -i 1 -q": SMI_QUERY}, dists=SGLANG_KUNLUN_DISTS)
    found = detect(probe, physical_id=1)
    assert found.usable and found.problems == []
    assert probe.run.calls == [["xpu-smi", "-i", "1", "-q"]]
    assert found.versions == {"driver": "5.0.21.26", "runtime": "5.0.21", "torch": "2.9.0", "xpytorch": "3.6.2",
                              "kunlun_ops": "0.1.205+223cef9e", "xspeedgate_ops": "1.2.0+680bed9.torch29",
                              "cocopod": "1.3.0+224a318", "xccl": None}


def test_older_tool_name_and_table_fallback(tmp_path):
    probe = probe_for(kunlun_root(tmp_path), {"xpu_smi": SMI_TABLE})
    found = detect(probe, physical_id=0)
    assert [c[0] for c in probe.run.calls] == ["xpu-smi", "xpu-smi", "xpu_smi", "xpu_smi"]
    assert found.versions["driver"] == "5.0.21.26" and found.smi.card["pci"] == "00000000:06:00.0"


def test_the_xpytorch_build_is_found_under_its_other_distribution_names(tmp_path):
    dists = {"torch": "2.5.1", "torch_xmlir": "2.5.1.4"}
    assert detect(probe_for(kunlun_root(tmp_path), dists=dists)).versions["xpytorch"] == "2.5.1.4"


def test_without_the_control_node_a_same_named_tool_is_not_believed(tmp_path):
    probe = probe_for(tmp_path, {"xpu-smi -i 0 -q": SMI_QUERY})
    found = detect(probe)
    assert not found.usable and probe.run.calls == []
    assert any("dev/xpuctrl does not exist" in p for p in found.problems)


def test_a_bare_host_records_what_is_missing(tmp_path):
    found = detect(probe_for(kunlun_root(tmp_path), dists={}, modules={}))
    assert not found.usable
    assert any("xpu-smi did not run" in p for p in found.problems)
    assert any("torch_xmlir is not importable" in p and "xpytorch" in p for p in found.problems)
    assert set(found.versions.values()) == {None}


def test_attributes_and_library_files_no_vendor_source_has_are_not_read(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "libbkcl.so.2.4.0").write_bytes(b"")
    module = types.SimpleNamespace(__version__="2.1.0", __bkcl_version__="2.3.1", __xre_version__="5.0",
                                   __file__=str(tmp_path / "pkg" / "__init__.py"))
    found = detect(probe_for(kunlun_root(tmp_path), modules={"torch_xmlir": module}, dists={}))
    assert found.versions["xccl"] is None and found.versions["runtime"] is None
    assert "2.3.1" not in found.versions.values() and "2.4.0" not in found.versions.values()


@pytest.mark.parametrize("text,parts", [("5.0.21.26", (5, 0, 21, 26)), ("2.5.1+cu124", (2, 5, 1)), ("v3.2", (3, 2))])
def test_version_tuples(text, parts):
    assert version_tuple(text) == parts


def test_ranges_and_build_labels():
    assert in_range("5.0.21", ">=5,<6") and not in_range("4.0.3", ">=5.0")
    assert in_range("2.0", ">=2.0.0")  # shorter versions are padded with zeros
    assert in_range("1.2.0+680bed9.torch29", "+torch29") and in_range("1.2.0+680bed9.torch29", ">=1.2,+torch29")
    assert not in_range("1.1.0+53992ca", "+torch29") and not in_range("1.2.0", "+torch29")
    assert not in_range("1.2.0+torch290", "+torch29")  # a label is a whole part, not a prefix
    with pytest.raises(ValueError, match="malformed"):
        in_range("1.0", "about 1")


def deployment(dists, **extra):
    return {"driver": "5.0.21.26", "runtime": "5.0.21", "xccl": None, "kunlun-infer-kunlun": "0.1.0",
            **dists, **extra}


def test_both_observed_deployments_pass_the_shipped_matrix():
    for dists in (VLLM_KUNLUN_DISTS, SGLANG_KUNLUN_DISTS):
        assert check_matrix(deployment(dists)).ok


def test_an_old_kernel_library_on_torch_251_is_named_with_its_evidence():
    result = check_matrix(deployment(VLLM_KUNLUN_DISTS, kunlun_ops="0.1.40"))
    assert len(result.mismatches) == 1
    message = result.mismatches[0]
    assert message.startswith("torch 2.5.1 needs kunlun_ops >=0.1.58, found kunlun_ops 0.1.40 (")
    assert OBSERVED in message and "vLLM-Kunlun" in message and "not a published matrix" in message


def test_a_kernel_build_for_another_torch_is_named_on_torch_29():
    result = check_matrix(deployment(SGLANG_KUNLUN_DISTS, xspeedgate_ops="1.1.0+53992ca"))
    assert [m.split(" (")[0] for m in result.mismatches] == [
        "torch 2.9.0 needs xspeedgate_ops +torch29, found xspeedgate_ops 1.1.0+53992ca"]
    old_xpytorch = check_matrix(deployment(SGLANG_KUNLUN_DISTS, xpytorch="3.4.0"))
    assert any(m.startswith("torch 2.9.0 needs xpytorch >=3.6,<3.7") for m in old_xpytorch.mismatches)


def test_xre_outside_5x_is_named_for_either_deployment():
    for dists in (VLLM_KUNLUN_DISTS, SGLANG_KUNLUN_DISTS):
        result = check_matrix(deployment(dists, runtime="6.0.1"))
        assert any("needs runtime >=5,<6, found runtime 6.0.1" in m for m in result.mismatches)


def test_torch_older_than_the_projects_floor_is_named():
    result = check_matrix(deployment(VLLM_KUNLUN_DISTS, torch="2.4.1"))
    assert result.mismatches == ["kunlun-infer-kunlun 0.1.0 needs torch >=2.5, found torch 2.4.1 "
                                 "(kunlun_infer is tested on torch 2.5 and later (README, 'Torch versions'))"]


def test_unknown_versions_are_reported_unchecked_with_the_reason():
    result = check_matrix(deployment(SGLANG_KUNLUN_DISTS), unknown_why=UNREADABLE)
    assert result.ok
    assert result.unchecked == ["torch >=2.9,<2.10 / xccl >=3.1,<3.2 (unknown: xccl: no published interface "
                                "reports the collective library's version)"]
    everything_unknown = check_matrix({})
    assert len(everything_unknown.unchecked) == len(MATRIX)


def test_every_shipped_rule_says_where_it_comes_from():
    assert all(rule.evidence for rule in MATRIX)
    vendor_rules = [r for r in MATRIX if r.subject != "kunlun-infer-kunlun"]
    assert vendor_rules and all(r.evidence.startswith(OBSERVED) for r in vendor_rules)


def test_custom_rules():
    rules = (PairRule("xccl", ">=3", "runtime", ">=6"),)
    assert check_matrix({"xccl": "3.1", "runtime": "5.9"}, rules).mismatches == [
        "xccl 3.1 needs runtime >=6, found runtime 5.9"]
    assert check_matrix({"xccl": "2.9", "runtime": "5.9"}, rules).ok  # the rule does not apply
