"""``kunlun-infer config``: the composed config, and one clear line for bad input."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import yaml

from kunlun_infer.cli import main
from kunlun_infer.hookspecs import HOOK_API_VERSION_STR


def run_cli(*argv):
    out, err = io.StringIO(), io.StringIO()
    code = main(list(argv), stdout=out, stderr=err)
    return code, out.getvalue(), err.getvalue()


def test_prints_the_composed_config_as_yaml():
    code, out, _ = run_cli("config", "memory=simple", "scheduler=latency", "scheduler.max_num_seqs=3")
    assert code == 0
    cfg = yaml.safe_load(out)
    assert cfg["memory"]["name"] == "simple" and cfg["scheduler"]["max_num_seqs"] == 3
    assert cfg["scheduler"]["max_num_batched_tokens"] == 512 and "hydra" not in cfg


def test_json_flag():
    code, out, _ = run_cli("config", "--json", "server.port=9000")
    assert code == 0 and json.loads(out)["server"]["port"] == 9000


def test_unknown_device_exits_non_zero_with_one_line_listing_cpu(tmp_path):
    script = os.path.join(os.path.dirname(sys.executable), "kunlun-infer")
    proc = subprocess.run([script, "config", "device=nosuchchip"], capture_output=True, text=True,
                          cwd=tmp_path, stdin=subprocess.DEVNULL, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "device=nosuchchip" in lines[0] and "cpu" in lines[0].split("available:")[1]
    assert proc.stdout == "" and "Traceback" not in proc.stderr
    assert list(tmp_path.iterdir()) == []  # no outputs/ folder


def test_bad_value_names_key_value_and_type():
    code, _, err = run_cli("config", "scheduler.max_num_seqs=abc")
    assert code == 2
    assert err.startswith("kunlun-infer: error: scheduler.max_num_seqs=abc") and "expected int" in err
    assert err.count("\n") == 1


def test_debug_flag_adds_the_traceback():
    code, _, err = run_cli("config", "device=nosuchchip", "--debug")
    assert code == 2 and "Traceback" in err
    assert err.strip().splitlines()[-1].startswith("kunlun-infer: error: device=nosuchchip: no such option")


def test_usage_errors():
    assert run_cli("config", "stray")[0] == 2
    code, _, err = run_cli("config", "--colour")
    assert code == 2 and "unknown flag '--colour'" in err and "--json" in err
    code, _, err = run_cli("nosuchcommand")
    assert code == 2 and "unknown command 'nosuchcommand'" in err and "config" in err and "plugins" in err


def test_log_level_shows_runtime_logs_and_is_removed_afterwards():
    import logging

    handlers = list(logging.getLogger().handlers)
    code, _, err = run_cli("config", "--log-level", "DEBUG")
    assert code == 0 and "kunlun_infer.runtime: composed config" in err
    assert logging.getLogger().handlers == handlers
    assert run_cli("config", "--log-level=LOUD")[0] == 2


def test_help_and_version():
    code, out, _ = run_cli("--help")
    assert code == 0 and "config" in out and "plugins" in out
    code, out, _ = run_cli("config", "--help")
    assert code == 0 and "usage: kunlun-infer config" in out and "Hydra override" in out
    code, out, _ = run_cli("--version")
    assert code == 0 and f"hook API {HOOK_API_VERSION_STR}" in out
    assert run_cli()[0] == 2
