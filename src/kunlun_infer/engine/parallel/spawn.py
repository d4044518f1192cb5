"""The worker processes an embedded engine starts: spawn, watch, and always reap.

Each rank above 0 is a fresh interpreter running ``python -m
kunlun_infer.engine.parallel.worker`` (the ``spawn`` start method's
isolation, without ``multiprocessing``'s extras: no re-import of the caller's
``__main__``, no resource-tracker process, no semaphores in shared memory). Its place and
config arrive as JSON on stdin; if it fails it leaves one line on stdout
before exiting. A worker also exits by itself when its parent disappears.

:meth:`WorkerProcesses.close` stops them (politely, then by force); a
``weakref.finalize`` does the same at interpreter exit or when the object is
collected, so no child process outlives the engine.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
import weakref
from typing import Any

log = logging.getLogger("kunlun_infer.framework")


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _reap(procs: list[subprocess.Popen], grace_s: float) -> None:
    """Wait up to ``grace_s`` for ``procs`` to exit, then terminate, then kill; close their pipes."""
    for sig, wait_s in ((None, grace_s), (signal.SIGTERM, 1.0), (signal.SIGKILL, 5.0)):
        alive = [p for p in procs if p.poll() is None]
        if not alive:
            break
        if sig is not None:
            for p in alive:
                with contextlib.suppress(ProcessLookupError):
                    p.send_signal(sig)
        deadline = time.monotonic() + wait_s
        for p in alive:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        for pipe in (p.stdin, p.stdout):
            if pipe is not None and not pipe.closed:
                pipe.close()


class WorkerProcesses:
    """Ranks ``1 .. world_size-1`` as child processes of this one."""

    def __init__(self, *, config: dict[str, Any], world_size: int, init_method: str, num_threads: int,
                 cpus: list[list[int]] | None = None) -> None:
        """``num_threads``: each rank's torch threads; ``cpus``: the CPUs of each rank (this one's first), or
        ``None`` to leave the ranks unbound."""
        self.procs: dict[int, subprocess.Popen] = {}
        self._last_words: dict[int, str] = {}
        procs: list[subprocess.Popen] = []
        # the finalizer holds the list, not self: it reaps at interpreter exit or when self is collected
        self._finalizer = weakref.finalize(self, _reap, procs, 0.0)
        level = logging.getLogger("kunlun_infer").getEffectiveLevel()
        for rank in range(1, world_size):
            job = {"config": config, "rank": rank, "world_size": world_size, "local_rank": rank,
                   "init_method": init_method, "parent_pid": os.getpid(), "log_level": level,
                   "num_threads": num_threads, "cpus": None if cpus is None else cpus[rank]}
            proc = subprocess.Popen([sys.executable, "-m", "kunlun_infer.engine.parallel.worker"],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True)
            procs.append(proc)
            self.procs[rank] = proc
            proc.stdin.write(json.dumps(job).encode())
            proc.stdin.close()
        log.info("started %d tensor-parallel worker(s): pids %s", len(procs), [p.pid for p in procs])

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs.values()]

    def dead(self) -> list[str]:
        """One line per worker that is no longer running: rank, pid, how it ended, its last words."""
        lines = []
        for rank, proc in self.procs.items():
            code = proc.poll()
            if code is None:
                continue
            if rank not in self._last_words:
                said = b""
                if proc.stdout is not None and not proc.stdout.closed:
                    said = proc.stdout.read()
                    proc.stdout.close()
                self._last_words[rank] = said.decode(errors="replace").strip()
            said = self._last_words[rank]
            lines.append(f"worker rank {rank} (pid {proc.pid}) {_describe_exit(code)}"
                         + (f": {said}" if said else ""))
        return lines

    def close(self, grace_s: float) -> None:
        """Give the workers ``grace_s`` to leave on their own, then stop them by force. Idempotent."""
        self._finalizer.detach()
        _reap(list(self.procs.values()), grace_s)
