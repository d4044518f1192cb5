"""perf_cpu's verdicts on a shared host: batch-1 decode against a peer measured in turns is judged turn by turn,
so one turn that met a different level of the host's bandwidth than its partner does not decide the target."""

import pytest

from tests.scripts import load_script


@pytest.fixture(scope="module")
def perf_cpu():
    return load_script("benchmarks/perf_cpu.py")


def verdicts(perf_cpu, result, peer, ours):
    lines, checked = [], []

    def check(name, value, target, higher, fmt):
        checked.append((name, value))
        lines.append(f"{name}: {value:{fmt}}")

    perf_cpu.b1_versus(lines, check, result, "bfloat16", peer, ours, "bf16 b1 decode", 1.0)
    return checked, lines


def test_turns_are_judged_by_the_median_of_their_ratios(perf_cpu):
    # the Zen 4 run this came from: the peer's first repeat met the host's faster memory, ours did not
    result = {"paired_b1": {"bfloat16": {"peer": "llama.cpp bf16", "ours_ms": [27.1, 28.5, 27.3],
                                         "theirs_ms": [21.6, 33.3, 31.8]}}}
    checked, lines = verdicts(perf_cpu, result, {"decode_b1_ms_per_token": 23.8}, {"decode_b1_ms_per_token": 17.9})
    (name, value), = checked
    assert "in turns" in name
    assert value == pytest.approx(31.8 / 27.3)  # the middle of 0.80, 1.17 and 1.16
    # the other readings stay in view: every turn, the best of each side, and the separate phases
    assert "0.80, 1.17, 1.16" in lines[-1]
    assert "best of each side: 0.80" in lines[-1]
    assert "separate phases: 1.33" in lines[-1]


def test_without_every_turn_of_the_peer_the_separate_phases_decide(perf_cpu):
    result = {"paired_b1": {"bfloat16": {"peer": "llama.cpp bf16", "ours_ms": [27.1, 28.5],
                                         "theirs_ms": [21.6, float("nan")]}}}
    checked, _ = verdicts(perf_cpu, result, {"decode_b1_ms_per_token": 23.8}, {"decode_b1_ms_per_token": 17.9})
    assert checked == [("bf16 b1 decode", pytest.approx(23.8 / 17.9))]
