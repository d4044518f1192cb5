"""``kunlun-infer serve`` as a user runs it: loopback by default, answers, stops cleanly on Ctrl-C."""

import io
import os
import re
import signal
import socket
import subprocess
import sys

import httpx

from kunlun_infer.cli import main
from tests.engine.tiny_models import engine_overrides


def test_serve_command_binds_loopback_serves_and_shuts_down_gracefully(chat_folder):
    cmd = [sys.executable, "-m", "kunlun_infer", "serve", f"model.path={chat_folder}", "server.port=0",
           "server.model_name=cli-model", *engine_overrides()]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        match = re.search(r"on http://(127\.0\.0\.1):(\d+)", line)
        assert match, (line, proc.stderr.read() if proc.poll() is not None else "")
        url = f"http://{match[1]}:{match[2]}"
        assert httpx.get(f"{url}/health", timeout=30).json() == {"status": "ok"}
        resp = httpx.post(f"{url}/v1/completions", json={"model": "cli-model", "prompt": "hi", "max_tokens": 3},
                          timeout=30)
        assert resp.status_code == 200 and len(resp.json()["choices"]) == 1
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "Traceback" not in proc.stderr.read()


def test_serve_refuses_a_busy_port_naming_the_keys(chat_folder):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        err = io.StringIO()
        code = main(["serve", f"model.path={chat_folder}", f"server.port={port}"], stdout=io.StringIO(), stderr=err)
    assert code == 2 and "server.port" in err.getvalue() and str(port) in err.getvalue()
