"""A serving process's threads allocate from glibc's main arena (``host_malloc.one_host_arena``), so that the
engine loop's large torch tensors (float32 logits, the sampler's probabilities) reuse the last step's pages."""

from __future__ import annotations

import json
import resource
import subprocess
import sys

import pytest

from kunlun_infer.engine import host_malloc

pytestmark = pytest.mark.skipif(host_malloc.glibc() is None, reason="the arenas are glibc's")

# Steps of a thread other than the main one, each making the float32 logits of 128 rows of a 151936-token
# vocabulary (74 MiB) and the probabilities over them; prints the page faults of three steps after four, and what
# one_host_arena answered (argv[1]: "one" asks for it first, "default" leaves glibc's choice; "late" asks after a
# thread made an arena of its own).
_STEPS = """
import json, resource, sys, threading, torch
from kunlun_infer.engine import host_malloc
from kunlun_infer.plugins import cpu_memory
def warm():
    torch.ones(1 << 20).sum()
answer = None
if sys.argv[1] == "one":
    answer = host_malloc.one_host_arena()
elif sys.argv[1] == "late":
    other = threading.Thread(target=warm)
    other.start()
    other.join()
    answer = host_malloc.one_host_arena()
cpu_memory.keep_freed_host_memory()
logits = torch.randn(128, 151936, dtype=torch.bfloat16)
result = {"answer": answer}
def steps():
    def step():
        probs = torch.softmax(logits.float() / 0.8, dim=-1)
        return int(probs.argmax(dim=-1)[0])
    tokens = [step() for _ in range(4)]  # glibc's free lists settle where each block goes within a few
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    tokens += [step() for _ in range(3)]
    result["faults"] = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    result["same"] = len(set(tokens)) == 1
    result["arenas"] = host_malloc.host_arenas()
thread = threading.Thread(target=steps)
thread.start()
thread.join()
print(json.dumps(result))
"""


def _steps(mode: str) -> dict:
    done = subprocess.run([sys.executable, "-c", _STEPS, mode], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_a_thread_of_a_process_with_one_arena_reuses_its_large_tensors_pages():
    one, default = _steps("one"), _steps("default")
    step_pages = 3 * (74 << 20) // resource.getpagesize()  # the logits, divided, and their softmax
    assert one["answer"] is True and one["arenas"] == 1 and one["same"], one
    assert one["faults"] < step_pages // 20, one  # three steps: (almost) nothing faulted in again
    assert default["arenas"] > 1 and default["same"], default
    assert default["faults"] > step_pages, default  # glibc's own choice: the thread's arena maps them every step


def test_one_arena_is_refused_once_a_thread_has_an_arena_of_its_own():
    late = _steps("late")
    assert late["answer"] is False and late["arenas"] > 1, late
