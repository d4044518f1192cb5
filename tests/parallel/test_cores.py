"""The ranks an embedded engine starts on its host take disjoint shares of its CPUs, NUMA nodes whole."""

from __future__ import annotations

from pathlib import Path

import pytest

from kunlun_infer.engine.parallel.cores import core_shares, format_cpu_list, numa_nodes, parse_cpu_list


def fake_sysfs(root: Path, nodes: list[list[int]], smt: int) -> Path:
    """A sysfs tree of ``nodes`` (their CPUs), ``smt`` hardware threads a core numbered as Linux does on x86:
    the first thread of every core first (0 .. cores-1), then the second threads, so a core's threads lie far
    apart."""
    cpus = sorted(c for node in nodes for c in node)
    cores = len(cpus) // smt
    for i, node in enumerate(nodes):
        (root / "node" / f"node{i}").mkdir(parents=True)
        (root / "node" / f"node{i}" / "cpulist").write_text(format_cpu_list(node) + "\n")
    for cpu in cpus:
        topology = root / "cpu" / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        core = cpu % cores
        package = next(i for i, node in enumerate(nodes) if cpu in node)
        (topology / "core_id").write_text(f"{core}\n")
        (topology / "physical_package_id").write_text(f"{package}\n")
    return root


def test_cpu_lists_read_and_write_as_taskset_does():
    assert parse_cpu_list("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert format_cpu_list([11, 0, 1, 2, 3, 8, 10]) == "0-3,8,10-11"
    assert format_cpu_list(parse_cpu_list("5")) == "5"


def test_two_sockets_give_each_rank_a_whole_node_with_its_cores_hardware_threads(tmp_path):
    # 2 sockets x 4 cores x 2 threads: node 0 holds CPUs 0-3 and their siblings 8-11
    sysfs = fake_sysfs(tmp_path, [[0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15]], smt=2)
    assert numa_nodes(sysfs) == [[0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15]]
    assert core_shares(range(16), 2, sysfs) == [[0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15]]
    # four ranks on two nodes: each node split by whole cores, no core's threads in two ranks
    assert core_shares(range(16), 4, sysfs) == [[0, 1, 8, 9], [2, 3, 10, 11], [4, 5, 12, 13], [6, 7, 14, 15]]


def test_the_shares_stay_within_the_cpus_the_process_may_use(tmp_path):
    sysfs = fake_sysfs(tmp_path, [[0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15]], smt=2)
    # taskset to node 1 alone: its cores split among three ranks, siblings together
    shares = core_shares([4, 5, 6, 7, 12, 13, 14, 15], 3, sysfs)
    assert shares == [[4, 12], [5, 13], [6, 7, 14, 15]]
    # uneven nodes (a part of node 0 only): whole cores in node order rather than unequal nodes
    assert core_shares([0, 1, 8, 9, 4, 5, 6, 7, 12, 13, 14, 15], 2, sysfs) == [[0, 1, 4, 8, 9, 12],
                                                                               [5, 6, 7, 13, 14, 15]]


def test_one_node_of_single_threaded_cores_and_too_few_cpus(tmp_path):
    sysfs = fake_sysfs(tmp_path, [[0, 1, 2]], smt=1)
    assert core_shares([0, 1, 2], 2, sysfs) == [[0], [1, 2]]
    assert core_shares([0, 1, 2], 3, sysfs) == [[0], [1], [2]]
    assert core_shares([0, 1, 2], 4, sysfs) is None  # fewer CPUs than ranks: nothing is bound
    # two hardware threads of one core for two ranks: the threads are split rather than nothing bound
    assert core_shares([0, 1], 2, fake_sysfs(tmp_path / "smt", [[0, 1]], smt=2)) == [[0], [1]]


def test_without_a_sysfs_the_cpus_split_in_order(tmp_path):
    assert core_shares(range(8), 2, tmp_path / "none") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(ValueError):
        parse_cpu_list("a-b")
