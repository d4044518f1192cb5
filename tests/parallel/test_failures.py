"""A rank that dies or hangs ends in WorkerError within the timeout; nothing outlives the engine.

Each test spawns its own rank 1 (a failure breaks the group), so the comm
timeout is short here: the hang test waits for it. It also bounds the
rendezvous of a spawned rank, so it leaves room for a slow start on a busy machine.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from kunlun_infer import LLM, ModelLoadError, SamplingParams, WorkerError
from tests.parallel.conftest import overrides

TIMEOUT_S = 8
LONG = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)


def tp_llm(folder, **keys) -> LLM:
    return LLM(model=str(folder), overrides=overrides(2, **keys) + [f"comm.timeout_s={TIMEOUT_S}"])


def running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def gone(pids: list[int]) -> bool:
    return not any(running(pid) for pid in pids)


def shared_memory_names(pids: list[int]) -> list[str]:
    """Names in ``/dev/shm`` that carry one of ``pids`` (a part of the name between - _ or .): what a process
    would leave behind there."""
    return [name for name in os.listdir("/dev/shm") if {str(pid) for pid in pids} & set(re.split(r"[-_.]", name))]


def segments_made_here() -> list[str]:
    """The names in ``/dev/shm`` of the segments this process (rank 0) made for its ranks' collectives."""
    return [name for name in os.listdir("/dev/shm") if name.startswith(f"kunlun_infer-{os.getpid()}-")]


def shared_memory_of(pids: list[int]) -> list[str]:
    """Shared-memory segments (``/dev/shm``) that ``pids`` have mapped or open, or that carry their pid."""
    found = shared_memory_names(pids)
    for pid in pids:
        proc = psutil.Process(pid)
        found += [m.path for m in proc.memory_maps() if m.path.startswith("/dev/shm")]
        found += [f.path for f in proc.open_files() if f.path.startswith("/dev/shm")]
    return found


def my_workers() -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True)
            if "kunlun_infer.engine.parallel.worker" in " ".join(p.cmdline())]


def steps_until_worker_error(llm: LLM) -> tuple[WorkerError, float]:
    started = time.monotonic()
    with pytest.raises(WorkerError) as caught:
        while llm.engine.has_unfinished():
            llm.engine.step()
    return caught.value, time.monotonic() - started


@pytest.mark.parametrize("how", ["killed", "stopped"])
def test_a_worker_that_dies_or_hangs_mid_generation_raises_worker_error(how, tiny_model):
    llm = tp_llm(tiny_model("llama"))
    try:
        (pid,) = llm.engine.parallel.workers.pids
        request = llm.engine.add_request(list(range(1, 20)), LONG)
        for _ in range(3):
            llm.engine.step()
        os.kill(pid, signal.SIGKILL if how == "killed" else signal.SIGSTOP)
        error, waited = steps_until_worker_error(llm)
        assert waited < TIMEOUT_S + 2
        if how == "killed":
            assert f"pid {pid}" in str(error) and "SIGKILL" in str(error)
        else:
            assert f"comm.timeout_s={TIMEOUT_S}" in str(error)
        assert request not in llm.engine._requests  # its request was ended, its blocks returned
        stats = llm.engine.stats()
        assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
        llm.engine.add_request([1, 2, 3], LONG)
        with pytest.raises(WorkerError, match="start a new one"):  # the group stays out of service
            llm.engine.step()
    finally:
        llm.close()
    assert gone([pid]) and my_workers() == []


def test_an_idle_engine_keeps_its_workers_past_the_comm_timeout_and_leaves_no_shared_memory_behind(tiny_model):
    with tp_llm(tiny_model("llama")) as llm:
        workers = [psutil.Process(pid) for pid in llm.engine.parallel.workers.pids]
        busy_before = [sum(w.cpu_times()[:2]) for w in workers]
        time.sleep(TIMEOUT_S * 1.5)  # the workers' wait for a step would time out without heartbeats
        busy = [sum(w.cpu_times()[:2]) - b for w, b in zip(workers, busy_before)]
        assert max(busy) < 0.1 * TIMEOUT_S * 1.5, busy  # an idle worker naps in its wait (it spun 30% of a core)
        out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
        assert len(out[0].token_ids) == 3
        pids = llm.engine.parallel.workers.pids
        mapped = shared_memory_of(pids)
        # the ranks of one host meet in a shared-memory segment whose name went as soon as every rank had it open
        assert mapped and not [path for path in mapped if os.path.exists(path.removesuffix(" (deleted)"))]
        assert shared_memory_names(pids) == [] and segments_made_here() == []
    assert my_workers() == [] and gone(pids)
    assert shared_memory_names(pids) == [] and segments_made_here() == []


def test_a_model_that_cannot_be_split_fails_on_every_rank_and_leaves_no_process(tiny_model):
    with pytest.raises(ModelLoadError, match="cannot split this model over 3 ranks"):
        LLM(model=str(tiny_model("llama")), overrides=overrides(3))  # 4 attention heads over 3 ranks
    assert my_workers() == []


EXIT_WITHOUT_CLOSE = """
    import os, sys, time
    import kunlun_infer as ki
    llm = ki.LLM(model={folder!r}, overrides={overrides!r})
    print("PIDS", *llm.engine.parallel.workers.pids, flush=True)
    if sys.argv[1] == "killed":
        time.sleep(60)  # killed by the test meanwhile
"""


@pytest.mark.parametrize("how", ["exits", "killed"])
def test_workers_end_with_the_caller_even_without_close(how, tiny_model, tmp_path):
    # no `if __name__ == "__main__"` guard: workers never re-import the caller's script
    script = tmp_path / "app.py"
    script.write_text(textwrap.dedent(EXIT_WITHOUT_CLOSE.format(folder=str(tiny_model("llama")),
                                                                overrides=overrides(2))))
    app = subprocess.Popen([sys.executable, str(script), how], stdout=subprocess.PIPE, text=True)
    try:
        line = app.stdout.readline()
        assert line.startswith("PIDS"), line
        pids = [int(p) for p in line.split()[1:]]
        if how == "killed":
            app.kill()  # no atexit, no finalizer: the workers notice their parent is gone
        app.wait(timeout=60)
    finally:
        if app.poll() is None:
            app.kill()
        app.stdout.close()
    if how == "exits":
        assert app.returncode == 0 and gone(pids)  # reaped by the engine's finalizer before the caller ended
    deadline = time.monotonic() + 10
    while not gone(pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert gone(pids)
