"""``kunlun-infer serve fleet=cpu_simchip`` as a user runs it: a Ray cluster of its own on 127.0.0.1 only, one
endpoint over both replicas, and nothing left running after Ctrl-C."""

from __future__ import annotations

import ipaddress
import os
import re
import signal
import subprocess
import sys

import httpx
import psutil

from tests.fleet.conftest import PAIR, fleet_engine_overrides


def listening(processes: list[psutil.Process]) -> set[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """The addresses the processes listen on (TCP; an IPv4 address mapped into IPv6 as the IPv4 one)."""
    pids = {p.pid for p in processes}
    found = set()
    for c in psutil.net_connections(kind="inet"):
        if c.status == psutil.CONN_LISTEN and c.pid in pids:
            ip = ipaddress.ip_address(c.laddr.ip)
            found.add(getattr(ip, "ipv4_mapped", None) or ip)
    return found


def test_serve_fleet_starts_a_loopback_cluster_serves_and_stops_everything(chat_model, tmp_path):
    cmd = [sys.executable, "-m", "kunlun_infer", "serve", *PAIR, f"model.path={chat_model}", "server.port=0",
           "server.model_name=tiny", "fleet.num_cpus=1", *fleet_engine_overrides()]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)  # the fleet keeps its own cluster on loopback
    log = (tmp_path / "stderr.txt").open("w+")  # Ray's processes write plenty: a pipe could fill and block
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
    family: list[psutil.Process] = []
    try:
        line = proc.stdout.readline()
        match = re.search(r"on http://(127\.0\.0\.1):(\d+)", line)
        assert match, (line, (tmp_path / "stderr.txt").read_text())
        url = f"http://{match[1]}:{match[2]}"
        family = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        addresses = listening(family)  # the endpoint and every Ray process: loopback only
        assert addresses and all(ip.is_loopback for ip in addresses), addresses
        for i in range(4):
            resp = httpx.post(f"{url}/v1/completions", timeout=60,
                              json={"model": "tiny", "prompt": f"hi {i}", "max_tokens": 3, "temperature": 0})
            assert resp.status_code == 200 and resp.json()["choices"][0]["finish_reason"] in ("length", "stop")
        metrics = httpx.get(f"{url}/metrics", timeout=30).text
        assert 'kunlun_infer_fleet_replica_up{replica="cpu"} 1' in metrics
        assert 'kunlun_infer_fleet_replica_up{replica="simchip"} 1' in metrics
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:  # a failed test still stops what it started, one process at a time
            for process in reversed(family or [psutil.Process(proc.pid)]):
                try:
                    process.kill()
                except psutil.NoSuchProcess:
                    pass
            proc.wait()
        log.close()
    _, alive = psutil.wait_procs(family, timeout=30)
    assert not alive, f"left running: {[p.pid for p in alive]}"
    assert "Traceback" not in (tmp_path / "stderr.txt").read_text()
