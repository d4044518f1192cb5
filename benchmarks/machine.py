"""What every benchmark prints and stores beside its figures: the machine it ran on, and how a figure is timed.

One place for the CPU's model name, the ISA flags that decide the kernels,
the threads, the kernel set chosen (and why), torch's build and the caps in
force; and for the best-of-N timing the benchmarks share. They import it as a
sibling file (``sys.path`` holds this folder when a benchmark runs as a
script).
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable
from typing import Any

import torch

#: the flags worth printing beside a figure (what decides the kernels)
ISA_FLAGS = ("avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
             "amx_bf16", "amx_int8")


def facts() -> dict[str, Any]:
    """The machine and the kernels in use, as JSON-ready values."""
    from kunlun_infer.plugins import cpu_device, cpu_native

    flags = cpu_device.cpu_flags()
    chosen = cpu_native.selection()
    return {"cpu_model": cpu_device._cpuinfo().get("model name") or platform.processor() or platform.machine(),
            "isa_flags": [f for f in ISA_FLAGS if f in flags], "cores": os.cpu_count(),
            "threads": torch.get_num_threads(), "kernel_set": chosen.name, "kernel_set_why": chosen.reason,
            "torch": torch.__version__, "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "isa_cap": os.environ.get(cpu_device.ISA_ENV, "native"), "load_average": list(os.getloadavg())}


def describe(machine: dict[str, Any]) -> str:
    """One line for a report: model, ISA flags, threads, kernel set."""
    return (f"{machine['cpu_model']}; ISA {' '.join(machine['isa_flags'])}; {machine['threads']} threads; "
            f"kernel set {machine['kernel_set']}")


def best_time(fn: Callable[[], Any], repeats: int, warm: bool = True) -> float:
    """The fastest of ``repeats`` timed calls of ``fn`` (seconds), after one untimed call unless ``warm`` is false
    (the caller has run that work already): first-call allocations and page faults are not the work's, and a
    neighbour's job can only slow a call down."""
    if warm:
        fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best
