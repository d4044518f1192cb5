"""``kunlun-infer plugins``: the table, the ``--json`` version matrix, and resilience to broken plugins."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

from kunlun_infer.cli import main
from kunlun_infer.hookspecs import HOOK_API_VERSION_STR
from tests.runtime.plugin_sources import BROKEN_IMPORT, COUNTING_MEMORY


def run_cli(*argv):
    out, err = io.StringIO(), io.StringIO()
    code = main(list(argv), stdout=out, stderr=err)
    return code, out.getvalue(), err.getvalue()


def test_json_lists_the_five_capabilities_with_versions(only_plugins):
    only_plugins("nothing-else")
    code, out, _ = run_cli("plugins", "--json")
    assert code == 0
    data = json.loads(out)
    assert data["framework"]["hook_api"] == HOOK_API_VERSION_STR
    assert data["logits_processors"] == {"xgrammar": "xgrammar"}
    assert set(data["capabilities"]) == {"device", "memory", "ops", "comm", "streams"}
    assert data["capabilities"]["memory"] == {"caching": "cpu-memory", "simple": "cpu-memory"}
    for row in data["plugins"]:
        assert row["version"] and row["api"] and row["stack"]["torch"] and row["error"] is None


def test_matrix_shows_outside_plugins_and_load_errors(make_distribution, only_plugins):
    make_distribution("kunlun-counting", COUNTING_MEMORY, version="1.2.3", entry_point="counting")
    make_distribution("kunlun-brokenchip", BROKEN_IMPORT, version="0.9", entry_point="brokenchip")
    only_plugins("counting", "brokenchip")
    code, out, _ = run_cli("plugins", "--json")
    assert code == 0
    rows = {row["name"]: row for row in json.loads(out)["plugins"]}
    assert rows["counting"]["distribution"] == "kunlun-counting"
    assert rows["counting"]["distribution_version"] == "1.2.3"
    assert rows["counting"]["options"] == {"memory": ["counting"]}
    assert rows["counting"]["config_options"] == ["memory=counting"]
    assert rows["counting"]["stack"] == {"counting-driver": "9.9"}
    assert "libchip.so" in rows["brokenchip"]["error"] and rows["brokenchip"]["distribution_version"] == "0.9"

    code, out, _ = run_cli("plugins")
    assert code == 0
    assert "counting" in out and "kunlun-counting 1.2.3" in out and "memory=counting" in out
    assert "brokenchip: plugin 'brokenchip'" in out and "FAILED" in out


def test_plugins_survives_strict_mode_to_show_the_error(make_distribution, only_plugins, monkeypatch):
    make_distribution("kunlun-brokenchip", BROKEN_IMPORT, entry_point="brokenchip")
    only_plugins("brokenchip")
    monkeypatch.setenv("KUNLUN_INFER_STRICT_PLUGINS", "1")
    code, out, _ = run_cli("plugins")
    assert code == 0 and "libchip.so" in out


def test_plugins_refuses_overrides():
    code, _, err = run_cli("plugins", "device=cpu")
    assert code == 2 and err.strip().count("\n") == 0 and "takes no config overrides" in err


def test_console_script_and_module_entry():
    env = dict(os.environ, KUNLUN_INFER_PLUGINS="nothing-else")
    script = os.path.join(os.path.dirname(sys.executable), "kunlun-infer")
    for argv in ([script, "plugins", "--json"], [sys.executable, "-m", "kunlun_infer", "plugins", "--json"]):
        proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert "cpu-memory" in json.loads(proc.stdout)["capabilities"]["memory"].values()
