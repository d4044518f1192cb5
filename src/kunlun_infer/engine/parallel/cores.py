"""The host's cores shared among the ranks an embedded engine starts on it.

Each rank takes an equal share of the CPUs this process may run on (its affinity: ``taskset`` or ``numactl``
choose them), and is bound to its share: its threads run there and, under Linux's default policy, the memory they
first touch (its weights, its KV cache) comes from the NUMA node of those CPUs. Where the NUMA nodes split evenly
among the ranks, each rank's share is whole nodes; else the CPUs are taken in order of node, package and core, so
that a core's hardware threads stay in one share. Where there are fewer CPUs than ranks, nothing is bound.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from pathlib import Path

#: where Linux describes the CPUs and NUMA nodes
SYSFS = Path("/sys/devices/system")


def parse_cpu_list(text: str) -> list[int]:
    """``"0-3,8,10-11"`` (sysfs and ``taskset -c`` syntax) as the CPU numbers it names, ascending."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        low, _, high = part.partition("-")
        cpus.update(range(int(low), int(high or low) + 1))
    return sorted(cpus)


def format_cpu_list(cpus: Iterable[int]) -> str:
    """CPU numbers as ``taskset -c`` takes them: ``[0, 1, 2, 5]`` → ``"0-2,5"``."""
    runs: list[list[int]] = []
    for cpu in sorted(set(cpus)):
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in runs)


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="ascii").strip()
    except OSError:
        return None


def numa_nodes(sysfs: Path = SYSFS) -> list[list[int]]:
    """The CPUs of each NUMA node that has any, in node order (one node holding every CPU where sysfs says
    nothing)."""
    nodes = []
    folder = sysfs / "node"
    names = sorted((p.name for p in folder.glob("node[0-9]*")), key=lambda n: int(n[4:])) if folder.is_dir() else []
    for name in names:
        cpus = parse_cpu_list(_read(folder / name / "cpulist") or "")
        if cpus:
            nodes.append(cpus)
    return nodes


def _core_key(cpu: int, sysfs: Path) -> tuple[int, int]:
    topology = sysfs / "cpu" / f"cpu{cpu}" / "topology"
    package, core = _read(topology / "physical_package_id"), _read(topology / "core_id")
    return (int(package) if package and package.lstrip("-").isdigit() else 0,
            int(core) if core and core.lstrip("-").isdigit() else cpu)


def core_shares(cpus: Iterable[int], ranks: int, sysfs: Path = SYSFS) -> list[list[int]] | None:
    """``ranks`` disjoint shares of ``cpus``, in rank order, equal to a core: whole NUMA nodes where those split
    evenly, else whole cores in order of node, package and core; ``None`` when there are fewer CPUs than ranks."""
    allowed = set(cpus)
    if ranks < 1 or len(allowed) < ranks:
        return None
    nodes = [[c for c in node if c in allowed] for node in numa_nodes(sysfs)]
    nodes = [node for node in nodes if node]
    if len(nodes) >= ranks and len(nodes) % ranks == 0 and {c for node in nodes for c in node} == allowed:
        per = len(nodes) // ranks
        shares = [sorted(c for node in nodes[r * per:(r + 1) * per] for c in node) for r in range(ranks)]
        if len({len(share) for share in shares}) == 1:  # whole nodes, where that gives every rank as many CPUs
            return shares
    node_of = {c: i for i, node in enumerate(nodes) for c in node}
    core_of = {c: (node_of.get(c, len(nodes)), *_core_key(c, sysfs)) for c in allowed}
    ordered = sorted(allowed, key=lambda c: (core_of[c], c))
    # whole cores to each share: a core's hardware threads are next to each other in `ordered`
    cores: list[list[int]] = []
    for cpu in ordered:
        key = core_of[cpu]
        if cores and cores[-1][0] == key:
            cores[-1][1].append(cpu)
        else:
            cores.append([key, [cpu]])
    if len(cores) < ranks:  # fewer cores than ranks: hardware threads apart, one CPU at a time
        return [ordered[r * len(ordered) // ranks:(r + 1) * len(ordered) // ranks] for r in range(ranks)]
    return [sorted(c for _, group in cores[r * len(cores) // ranks:(r + 1) * len(cores) // ranks] for c in group)
            for r in range(ranks)]


def rank_shares(threads: int, ranks: int) -> tuple[int, list[list[int]] | None]:
    """Each of ``ranks`` ranks' torch threads, out of this process's ``threads``, and CPUs (:func:`core_shares` of
    this process's affinity; ``None``: nothing to bind)."""
    shares = core_shares(os.sched_getaffinity(0), ranks) if hasattr(os, "sched_getaffinity") else None
    share = max(1, threads // ranks)
    if shares is not None:  # no more threads than CPUs in a rank's share
        share = min(share, min(len(cpus) for cpus in shares))
    return share, shares


def bind_process(cpus: Iterable[int]) -> None:
    """Bind every thread of this process (and the threads it starts later) to ``cpus``."""
    mask = set(cpus)
    os.sched_setaffinity(0, mask)
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError, ValueError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(task), mask)
