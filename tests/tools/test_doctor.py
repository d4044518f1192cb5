"""``kunlun-infer doctor``: stages pass on a healthy setup; broken plugins are named at the right stage."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

from kunlun_infer.ops import OP_SPECS
from kunlun_infer.runtime import compose_config

FUTURE_API_PLUGIN = '''
from kunlun_infer.capabilities import DictOpsProvider
from kunlun_infer.hookspecs import PluginInfo, hookimpl


@hookimpl
def kunlun_infer_plugin_info():
    return PluginInfo(name="nextgen-ops", version="2.1.0", api=">=2.0,<3", capabilities=("ops",))


@hookimpl
def kunlun_infer_ops_factories():
    return {"nextgen": lambda *, config, device: DictOpsProvider({}, name="nextgen")}
'''


def headline(out: str, stage: int) -> str:
    return next(line for line in out.splitlines() if f"] stage {stage}:" in line)


def test_doctor_passes_on_the_builtin_plugins(cli, tmp_path):
    result = cli("doctor", "sweep=1,4", "--no-progress", "--repro-dir", tmp_path)
    assert result.code == 0, result.out + result.err
    for stage in (1, 2, 3, 6):
        assert headline(result.out, stage).startswith("[PASS]")
    for stage in (4, 5):
        assert headline(result.out, stage).startswith("[N/A ]")
        assert "not applicable" not in headline(result.out, stage)  # the reason is printed instead
        assert "world size 1" in headline(result.out, stage)
    assert "round trip host -> cpu -> host exact" in result.out
    cfg = compose_config([])
    for capability in ("device", "memory", "ops", "comm", "streams"):  # the version matrix, one row each
        assert re.search(rf"^\s+{capability}\s+{cfg[capability].name}\s+\S+\s+\S+\s+builtin\s+>=1\.0,<2",
                         result.out, re.M), capability
    assert re.search(rf"op coverage: \d+ of {len(OP_SPECS)} ops from plugin ", result.out)
    assert "suggested: scheduler.max_num_seqs=" in result.out
    assert "doctor: all stages passed" in result.out
    assert not list(tmp_path.iterdir())  # nothing failed, so no repro


def test_doctor_json_report(cli):
    result = cli("doctor", "sweep=1,2", "--no-progress", "--json", "ops=simchip", "device=simchip",
                 "memory=simchip")
    assert result.code == 0, result.err
    report = result.json()
    assert report["ok"] is True and report["failed_stage"] is None
    assert [s["status"] for s in report["stages"]] == ["pass", "pass", "pass", "not applicable", "not applicable",
                                                      "pass"]
    coverage = report["stages"][1]["data"]["op_coverage"]
    assert coverage["paged_attention"] == "reference" and coverage["linear"] == "simchip"
    sweep = report["stages"][5]["data"]["sweep"]
    assert [p["value"] for p in sweep["points"]] == [1, 2]
    assert report["stages"][5]["data"]["suggested"]["scheduler.max_num_seqs"] in (1, 2)


def test_stage_2_names_a_plugin_for_another_hook_api(cli, make_distribution, tmp_path):
    make_distribution("kunlun-infer-nextgen", FUTURE_API_PLUGIN, version="2.1.0", entry_point="nextgen")
    repro_dir = tmp_path / "repro"
    result = cli("doctor", "ops=nextgen", "--no-progress", "--repro-dir", repro_dir)
    assert result.code == 1
    assert headline(result.out, 1).startswith("[PASS]")
    assert headline(result.out, 2).startswith("[FAIL]")
    assert "failure (layer: plugin, plugin: nextgen-ops, hook: kunlun_infer_plugin_info)" in result.out
    assert "the config chooses ops=nextgen" in result.out
    assert "kunlun-infer-nextgen 2.1.0" in result.out and "'>=2.0,<3'" in result.out
    assert "KUNLUN_INFER_DISABLE_PLUGINS=nextgen" in result.out
    for stage in (3, 4, 5, 6):
        assert headline(result.out, stage).startswith("[----]")
    assert "doctor: stopped at stage 2" in result.out
    assert [p.name for p in repro_dir.iterdir()] == ["test_kunlun_infer_repro_stage2_nextgen_ops.py"]


def test_stage_2_for_a_plugin_registered_by_code(cli):
    result = cli("doctor", "register=tests.tools.future_api_plugin", "ops=futureops", "--no-progress", "--json")
    assert result.code == 1
    stage = result.json()["stages"][1]
    assert stage["status"] == "fail"
    assert stage["failure"]["plugin"] == "future-ops" and stage["failure"]["layer"] == "plugin"
    assert any("another ops option" in step for step in stage["failure"]["next_steps"])


def test_a_broken_plugin_that_is_not_chosen_is_only_a_warning(cli):
    result = cli("doctor", "register=tests.tools.future_api_plugin", "stages=2", "--no-progress")
    assert result.code == 0
    assert "warning: plugin 'tests.tools.future_api_plugin' (not chosen) did not load" in result.out


def test_stage_3_names_the_wrong_op_and_its_repro_fails(cli, tmp_path, pytester):
    result = cli("doctor", "register=tests.tools.wrong_ops_plugin", "ops=wrongops", "--no-progress",
                 "--repro-dir", tmp_path)
    assert result.code == 1
    assert headline(result.out, 3).startswith("[FAIL]")
    assert "failure (layer: plugin, plugin: wrong-ops, hook: ops.rms_norm)" in result.out
    repro = tmp_path / "test_kunlun_infer_repro_stage3_rms_norm.py"
    assert f"repro: {repro}" in result.out
    text = repro.read_text()
    assert "OVERRIDES = ['ops=wrongops']" in text and "'(7, 64) float32'" in text and "wrong-ops 0.0.1" in text
    pytester.runpytest(str(repro), "-p", "no:cacheprovider").assert_outcomes(failed=1)
    # the same repro passes on a correct plugin: it fails for the fault, not for itself
    healthy = tmp_path / "test_healthy.py"
    healthy.write_text(text.replace("OVERRIDES = ['ops=wrongops']", "OVERRIDES = ['ops=torch']"))
    pytester.runpytest(str(healthy), "-p", "no:cacheprovider").assert_outcomes(passed=1)


def test_stage_3_finds_an_op_wrong_only_at_model_shapes(cli, tmp_path, pytester):
    result = cli("doctor", "register=tests.tools.late_bug_plugin", "ops=latebug", "stages=3", "--no-progress",
                 "--json", "--repro-dir", tmp_path)
    assert result.code == 1
    stage = result.json()["stages"][2]
    failure = stage["failure"]
    assert (failure["plugin"], failure["hook"], failure["layer"]) == ("late-bug", "ops.rms_norm", "plugin")
    assert "tiny model with only 'rms_norm' from the plugin" in failure["message"]
    assert any("match their references" in d for d in stage["details"])  # the sample check could not see it
    repro = tmp_path / "test_kunlun_infer_repro_stage3_rms_norm.py"
    assert failure["repro"] == str(repro) and repro.with_suffix(".safetensors").is_file()
    pytester.runpytest(str(repro), "-p", "no:cacheprovider").assert_outcomes(failed=1)


def test_stage_3_checks_an_attention_backend_and_names_a_wrong_one(cli, tmp_path, pytester, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parents[2]))  # the repros import the test plugin
    register = "register=tests.tools.padded_attention_plugin"
    good = cli("doctor", register, "ops=padded", "stages=3", "--no-progress", "--json")
    assert good.code == 0, good.out + good.err
    stage = good.json()["stages"][2]
    assert stage["data"]["attention_backend"] == "plugin"
    assert any("attention backend matches the reference backend in float32" in d for d in stage["details"])
    assert any("ops and attention backend equal the reference" in d for d in stage["details"])

    result = cli("doctor", register, "ops=padded-broken", "stages=3", "--no-progress", "--json",
                 "--repro-dir", tmp_path)
    assert result.code == 1
    failure = result.json()["stages"][2]["failure"]
    assert (failure["plugin"], failure["hook"]) == ("padded-attention", "ops.attention_backend")
    assert "attend output differs from the reference" in failure["message"]
    repro = tmp_path / "test_kunlun_infer_repro_stage3_attention_backend.py"
    assert failure["repro"] == str(repro)
    pytester.runpytest(str(repro), "-p", "no:cacheprovider").assert_outcomes(failed=1)
    healthy = tmp_path / "test_healthy.py"
    healthy.write_text(repro.read_text().replace("'ops=padded-broken'", "'ops=padded'"))
    pytester.runpytest(str(healthy), "-p", "no:cacheprovider").assert_outcomes(passed=1)


def test_stages_4_and_5_across_two_ranks(cli):
    result = cli("doctor", "parallel.tensor_size=2", "comm=gloo", "stages=5", "--no-progress")
    assert result.code == 0, result.out + result.err
    assert headline(result.out, 4).startswith("[PASS]")
    assert "exact on 2 ranks" in result.out
    assert headline(result.out, 5).startswith("[PASS]")
    assert "identical at tensor_size=2 and 1" in result.out


def test_stage_4_names_the_collective_at_fault(cli, tmp_path):
    result = cli("doctor", "register=tests.tools.bad_comm_plugin", "comm=badgather", "parallel.tensor_size=2",
                 "--no-progress", "--repro-dir", tmp_path)
    assert result.code == 1
    assert headline(result.out, 4).startswith("[FAIL]")
    assert "failure (layer: plugin, plugin: bad-gather, hook: comm.all_gather)" in result.out
    assert "Traceback" not in result.out
    repro = (tmp_path / "test_kunlun_infer_repro_stage4_all_gather.py").read_text()
    assert "WORLD_SIZE = 2" in repro and "MODULES = ['tests.tools.bad_comm_plugin']" in repro


def test_doctor_refuses_a_bad_override_in_one_line(cli):
    result = cli("doctor", "scheduler.max_num_seqs=many")
    assert result.code == 2
    assert result.err.count("\n") == 1 and "scheduler.max_num_seqs" in result.err


@pytest.mark.parametrize("argv, message", [(("stages=7",), "stages='7'"), (("sweep=0",), "sweep='0'")])
def test_doctor_parameters_are_checked(cli, argv, message):
    result = cli("doctor", *argv)
    assert result.code == 2 and message in result.err


def test_repro_docstring_survives_odd_messages(tmp_path):
    from kunlun_infer.tools.repro import Repro, write_repro

    repro = Repro(kind="device", stage=1, stage_name="device", subject="cpu", summary='a """ quote and C:\\path',
                  layer="hardware", plugin="cpu", hook="Device.open", overrides=[], modules=[], versions={})
    path = write_repro(repro, tmp_path)
    compile(path.read_text(), str(path), "exec")  # still valid Python
    assert textwrap.dedent("C:\\\\path") in path.read_text()


def test_stage_1_a_device_that_does_not_open(cli, tmp_path, pytester):
    result = cli("doctor", "register=tests.tools.unreachable_device_plugin", "device=unreachable", "--no-progress",
                 "--repro-dir", tmp_path)
    assert result.code == 1
    assert headline(result.out, 1).startswith("[FAIL]") and headline(result.out, 2).startswith("[----]")
    assert "failure (layer: plugin, plugin: broken-devices, hook: device.open)" in result.out
    assert "no device found at /dev/fake0" in result.out
    assert "check that the device is visible to this process" in result.out
    repro = tmp_path / "test_kunlun_infer_repro_stage1_broken_devices.py"
    pytester.runpytest(str(repro), "-p", "no:cacheprovider").assert_outcomes(failed=1)


def test_stage_1_data_that_does_not_come_back_points_at_the_hardware(cli, tmp_path):
    result = cli("doctor", "register=tests.tools.unreachable_device_plugin", "device=nowhere", "--no-progress",
                 "--json", "--repro-dir", tmp_path)
    assert result.code == 1
    failure = result.json()["stages"][0]["failure"]
    assert (failure["layer"], failure["plugin"]) == ("hardware", "broken-devices")
    assert failure["hook"] == "Device.torch_device (host <-> device copy)"


def test_the_reference_op_run_of_the_doctor_steps_eagerly():
    """Its table's reference ops read values on the host (a CUDA graph of them fails to capture): the doctor's
    reference runtime never offers a capture, though the runtime it wraps (and forwards everything else to) does."""
    from kunlun_infer.runtime import PluginManager, Runtime
    from kunlun_infer.tools.doctor.model_check import OpsRuntime, mixed_table

    manager = PluginManager.load()
    with Runtime.from_config(compose_config([], plugin_manager=manager), plugin_manager=manager) as runtime:
        calls = []
        runtime.capture_step = lambda fn: (fn(), "captured")[1]  # a plugin that captures everything
        reference = OpsRuntime(runtime, mixed_table(runtime, ()))
        assert reference.capture_step(lambda: calls.append("reference")) is None
        assert reference.capture_step is not runtime.capture_step and reference.device is runtime.device
        assert runtime.capture_step(lambda: calls.append("real")) == "captured"
        assert calls == ["real"]
