"""Lifecycle: engines created, used and closed over and over in one process leave nothing behind.

200 cycles of ``LLM.from_config`` → ``generate`` → ``close`` (each a full
start: plugin discovery, runtime, model load, warm-up, KV cache). After a
warm-up of a few cycles, the process's threads, open file descriptors, child
processes and resident memory must not grow. A few tensor-parallel cycles
(a spawned worker each) check that workers, their pipes and the engine's
heartbeat thread go with every close.

Each runs in an interpreter of its own: threads that libraries other tests used keep and resize by themselves
(gRPC's event-engine pool, which a Ray client leaves in the process) would otherwise count as this engine's.
"""

from __future__ import annotations

import gc
import subprocess
import sys
import threading
from pathlib import Path

import psutil

from kunlun_infer import LLM, SamplingParams
from kunlun_infer.runtime import compose_config
from tests.hardening.conftest import tiny_overrides

CYCLES = 200
WARM_UP = 20
RSS_NOISE = 0.05  # fraction of the resident set after warm-up


def ours(child: psutil.Process) -> bool:
    """A child this process started, not multiprocessing's resource tracker (one per interpreter, started by the
    first shared-memory segment or lock anything in the test session made, and kept until the interpreter exits)."""
    try:
        return "multiprocessing.resource_tracker" not in " ".join(child.cmdline())
    except psutil.NoSuchProcess:
        return False


def footprint() -> dict[str, int]:
    gc.collect()
    me = psutil.Process()
    return {"threads": me.num_threads(), "python_threads": threading.active_count(), "fds": me.num_fds(),
            "children": sum(ours(c) for c in me.children(recursive=True)), "rss": me.memory_info().rss}


def in_fresh_interpreter(check: str, folder: Path) -> None:
    """Run ``check(folder)`` of this module in a new Python process (this test's environment, one torch thread);
    its failure fails the test with its output."""
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-m", "tests.hardening.test_lifecycle", check, str(folder)], cwd=root,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{check} failed:\n{proc.stdout}\n{proc.stderr[-6000:]}"


def test_create_generate_close_cycles_leak_no_threads_files_processes_or_memory(tiny_folder):
    in_fresh_interpreter("engine_cycles", tiny_folder)


def test_tensor_parallel_cycles_leave_no_worker_pipe_or_thread(tiny_folder):
    in_fresh_interpreter("tensor_parallel_cycles", tiny_folder)


def engine_cycles(tiny_folder: Path) -> None:
    cfg = compose_config(tiny_overrides(tiny_folder, model__max_model_len=64, scheduler__max_num_seqs=2,
                                        scheduler__max_num_batched_tokens=32, cache__num_blocks=8))
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    expected = None
    before = None
    for cycle in range(CYCLES):
        if cycle == WARM_UP:
            before = footprint()
        llm = LLM.from_config(cfg)
        tokens = [o.token_ids for o in llm.generate([[1, 2, 3], "hi"], params, use_tqdm=False)]
        llm.close()
        expected = expected or tokens
        assert tokens == expected, f"cycle {cycle} generated differently"
    after = footprint()
    for key in ("threads", "python_threads", "fds", "children"):
        assert after[key] <= before[key], f"{key} grew over {CYCLES - WARM_UP} cycles: {before} -> {after}"
    growth = (after["rss"] - before["rss"]) / before["rss"]
    assert growth < RSS_NOISE, f"resident memory grew {growth:.1%} over {CYCLES - WARM_UP} cycles: " \
                               f"{before['rss'] >> 20} -> {after['rss'] >> 20} MiB"


def tensor_parallel_cycles(tiny_folder: Path) -> None:
    cfg = compose_config(tiny_overrides(tiny_folder, model__max_model_len=64, cache__num_blocks=8,
                                        parallel__tensor_size=2))
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    before = None
    for cycle in range(3):
        with LLM.from_config(cfg) as llm:
            (pid,) = llm.engine.parallel.workers.pids
            assert len(llm.generate([[1, 2, 3]], params, use_tqdm=False)[0].token_ids) == 3
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        now = footprint()
        assert now["children"] == 0, f"cycle {cycle} left a child process"
        before = before or now
        for key in ("threads", "python_threads", "fds"):
            assert now[key] <= before[key], f"{key} grew at cycle {cycle}: {before} -> {now}"


if __name__ == "__main__":
    import torch

    torch.set_num_threads(1)
    {"engine_cycles": engine_cycles, "tensor_parallel_cycles": tensor_parallel_cycles}[sys.argv[1]](Path(sys.argv[2]))
