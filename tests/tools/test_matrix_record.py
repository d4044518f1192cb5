"""The version matrix that remembers: doctor appends its outcome; plugins --matrix answers from it; the record
moves between machines with --export / --import."""

from __future__ import annotations

import copy
import json

import pytest

from kunlun_infer.tools import matrix_record as mr

CONFIG = {"device": "cpu", "memory": "caching", "ops": "cpu", "comm": "single", "streams": "sync"}


@pytest.fixture(scope="module")
def recorded_run(tmp_path_factory):
    """One real `doctor stages=2` run's record line (stages 1-2 are quick), reused by the tests below."""
    import io

    from kunlun_infer.cli import main

    path = tmp_path_factory.mktemp("record") / "runs.jsonl"
    out, err = io.StringIO(), io.StringIO()
    code = main(["doctor", "stages=2", "--no-progress", "--record", str(path)], stdout=out, stderr=err)
    assert code == 0, out.getvalue() + err.getvalue()
    assert f"recorded in {path}" in out.getvalue()
    (entry,) = mr.read_record(path)
    return entry


def write(path, *entries):
    path.write_text("".join(json.dumps(e) + "\n" for e in entries))
    return path


def variant(entry, *, outcome=None, when=None, failure=None, **plugin_changes):
    """A copy of ``entry`` as another run: new id, and ``plugin=(key, value)`` changes to its installed plugins."""
    other = copy.deepcopy(entry)
    other["id"] = f"{entry['id']}-{len(plugin_changes)}-{when}-{outcome}"
    if outcome:
        other["outcome"] = outcome
        other["failure"] = failure
    if when:
        other["when"] = when
    for name, (key, value) in plugin_changes.items():
        if key == "stack":
            other["installed"]["plugins"][name]["stack"].update(value)
        else:
            other["installed"]["plugins"][name][key] = value
    return other


def test_doctor_records_versions_stack_device_and_every_stage(recorded_run):
    entry = recorded_run
    assert entry["config"] == CONFIG and entry["outcome"] == "passed" and entry["failure"] is None
    assert [(s["number"], s["status"]) for s in entry["stages"]] == [(1, "pass"), (2, "pass")]  # stages=2
    assert entry["stages_run"] == [1, 2]
    installed = entry["installed"]
    assert installed["framework"]["kunlun-infer"] and installed["framework"]["hook_api"]
    assert {"cpu", "cpu-memory", "torch-ops", "simchip"} <= set(installed["plugins"])  # every plugin, not only chosen
    assert installed["plugins"]["torch-ops"]["stack"]["torch"]
    assert entry["device"]["identity"]["name"] == "cpu" and "torch" in entry["device"]["stack"]


def test_matrix_says_passed_for_the_same_plugins(cli, tmp_path, recorded_run):
    record = write(tmp_path / "r.jsonl", recorded_run)
    result = cli("plugins", "--matrix", "--record", record)
    assert result.code == 0, result.err
    assert "passed  device=cpu memory=caching ops=cpu comm=single streams=sync" in result.out
    assert "1 of 1 run(s) with these plugins passed" in result.out and "stages 1-2" in result.out


def test_matrix_says_failed_and_at_which_stage_when_the_latest_run_failed(cli, tmp_path, recorded_run):
    failure = {"stage": 3, "name": "single-device inference", "layer": "plugin", "plugin": "torch-ops",
               "hook": "ops.rms_norm", "message": "rms_norm differs from the reference by 0.5"}
    failed = variant(recorded_run, outcome="failed", when="2999-01-01T00:00:00+00:00", failure=failure)
    result = cli("plugins", "--matrix", "--json", "--record", write(tmp_path / "r.jsonl", recorded_run, failed))
    (answer,) = result.json()["configs"]
    assert answer["status"] == "failed" and (answer["runs"], answer["passed_runs"]) == (2, 1)
    text = cli("plugins", "--matrix", "--record", tmp_path / "r.jsonl").out
    assert "FAILED  device=cpu" in text
    assert "at stage 3 (single-device inference), layer plugin, plugin torch-ops: rms_norm differs" in text


def test_matrix_says_new_and_what_changed_when_a_serving_plugin_moved(cli, tmp_path, recorded_run):
    older = variant(recorded_run, **{"torch-ops": ("version", "0.0.9")})
    older = variant(older, cpu=("stack", {"torch": "2.5.1"}))
    result = cli("plugins", "--matrix", "--record", write(tmp_path / "r.jsonl", older))
    assert "new     device=cpu" in result.out and "never run with the plugins installed now" in result.out
    assert "torch-ops 0.0.9 (builtin) -> 0.1.0 (builtin)" in result.out
    assert "cpu: torch 2.5.1 -> " in result.out


def test_plugins_the_config_does_not_use_do_not_make_it_new(cli, tmp_path, recorded_run):
    other = variant(recorded_run, simchip=("version", "9.9.9"))
    other["installed"]["plugins"]["someone-elses"] = {"version": "1.0", "distribution": "x 1.0", "stack": {},
                                                     "options": {"ops": ["theirs"]}, "error": None}
    result = cli("plugins", "--matrix", "--json", "--record", write(tmp_path / "r.jsonl", other))
    assert [a["status"] for a in result.json()["configs"]] == ["passed"]


def test_a_config_whose_plugin_is_gone_cannot_run_here(cli, tmp_path, recorded_run):
    gone = copy.deepcopy(recorded_run)
    gone["config"]["device"] = "retired-chip"
    gone["installed"]["plugins"]["retired"] = {"version": "1.0", "distribution": "retired 1.0", "stack": {},
                                               "options": {"device": ["retired-chip"]}, "error": None}
    result = cli("plugins", "--matrix", "--record", write(tmp_path / "r.jsonl", gone))
    assert "n/a     device=retired-chip" in result.out and "no installed plugin serves device=retired-chip" in result.out


def test_export_and_import_share_the_record_once(cli, tmp_path, recorded_run):
    mine = write(tmp_path / "mine.jsonl", recorded_run, variant(recorded_run, outcome="failed",
                                                                when="2999-01-01T00:00:00+00:00"))
    shared = tmp_path / "team.jsonl"
    assert "exported 2 doctor run(s)" in cli("plugins", "--export", shared, "--record", mine).out
    theirs = tmp_path / "theirs" / "runs.jsonl"
    assert "imported 2 doctor run(s)" in cli("plugins", "--import", shared, "--record", theirs).out
    again = cli("plugins", "--import", shared, "--record", theirs)
    assert "imported 0 doctor run(s)" in again.out and "(2 already there)" in again.out
    assert len(mr.read_record(theirs)) == 2
    assert cli("plugins", "--matrix", "--json", "--record", theirs).json()["configs"][0]["status"] == "failed"


@pytest.mark.parametrize("content,message", [
    ("not json\n", "bad.jsonl:1: not JSON"),
    ('{"schema": 1}\n', "bad.jsonl:1: not a doctor run record (missing id, when, config"),
])
def test_a_file_that_is_not_a_record_is_refused_naming_file_and_line(cli, tmp_path, content, message):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(content)
    result = cli("plugins", "--import", bad, "--record", tmp_path / "r.jsonl")
    assert result.code != 0 and message in result.err
    assert not (tmp_path / "r.jsonl").exists()


def test_a_record_of_a_newer_schema_says_to_upgrade(tmp_path, recorded_run):
    newer = dict(recorded_run, schema=2)
    with pytest.raises(mr.RecordError, match="record schema 2, this kunlun-infer reads schema 1; upgrade"):
        mr.read_record(write(tmp_path / "r.jsonl", newer))


def test_record_path_precedence(tmp_path):
    env = {"KUNLUN_INFER_MATRIX_RECORD": str(tmp_path / "env.jsonl"), "XDG_STATE_HOME": str(tmp_path / "state")}
    assert mr.record_path(tmp_path / "flag.jsonl", env) == tmp_path / "flag.jsonl"
    assert mr.record_path(None, env) == tmp_path / "env.jsonl"
    assert mr.record_path(None, {"XDG_STATE_HOME": str(tmp_path / "state")}) == (
        tmp_path / "state" / "kunlun_infer" / "doctor-runs.jsonl")
    assert mr.record_path(None, {"HOME": "/nowhere"}).parts[-4:] == (".local", "state", "kunlun_infer",
                                                                     "doctor-runs.jsonl")


def test_doctor_without_record_and_with_an_unwritable_record(cli, tmp_path):
    record = tmp_path / "r.jsonl"
    assert cli("doctor", "stages=1", "--no-progress", "--no-record", "--record", record).code == 0
    assert not record.exists()
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    result = cli("doctor", "stages=1", "--no-progress", "--record", blocked / "r.jsonl")
    assert result.code == 0 and "warning: cannot write the doctor record" in result.err


def test_an_empty_record_says_everything_is_new(cli, tmp_path):
    result = cli("plugins", "--matrix", "--record", tmp_path / "none.jsonl")
    assert result.code == 0 and "(0 run(s))" in result.out and "no doctor run recorded yet" in result.out


def test_a_failing_doctor_run_records_the_stage_layer_and_plugin(cli, tmp_path):
    record = tmp_path / "r.jsonl"
    result = cli("doctor", "register=tests.tools.unreachable_device_plugin", "device=unreachable", "--no-progress",
                 "--repro-dir", tmp_path, "--record", record)
    assert result.code == 1
    (entry,) = mr.read_record(record)
    assert entry["outcome"] == "failed" and entry["stages_run"] == [1]
    assert entry["failure"] == {"stage": 1, "name": entry["stages"][0]["name"], "layer": "plugin",
                                "plugin": "broken-devices", "hook": "device.open",
                                "message": entry["failure"]["message"]}
    assert "no device found at /dev/fake0" in entry["failure"]["message"]
    assert entry["installed"]["plugins"]["broken-devices"]["version"] == "0.0.4"
    # a plugin registered by code is not installed: later, that config cannot run without it
    assert "no installed plugin serves device=unreachable" in cli("plugins", "--matrix", "--record", record).out
