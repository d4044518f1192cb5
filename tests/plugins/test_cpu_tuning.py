"""``cpu_tuning``: the AVX2 GEMMs take tiles in chunks from the row count this CPU measured faster, measured once.

How fast either way is cannot be tested here (speed is for the benchmarks);
what is tested is that the measurement compares the two ways the library
really runs, that the rule picks what the ratios say, that the choice is
recorded, reused and set into the library, and that ``plugins`` shows it.
That both ways give the same results bit for bit is tested with the GEMMs
(``test_cpu_kernels``).
"""

from __future__ import annotations

import json
import logging
import shutil
import types

import pytest
import torch

from kunlun_infer.plugins import cpu_native, cpu_tuning
from tests.kernel_sets import _choose, native_kernel_set  # noqa: F401 - fixture


@pytest.mark.parametrize("ratios, expected", [
    ({8: 0.9, 10: 0.8, 16: 0.7, 96: 0.9}, 8),  # chunks faster everywhere
    ({8: 1.5, 10: 1.3, 16: 1.1, 48: 0.95, 96: 0.9}, 48),  # whole for few rows, chunks from 48
    ({8: 1.2, 10: 0.9, 16: 1.05, 24: 0.9, 96: 0.8}, 10),  # a small loss between wins: chunks still from 10
    ({8: 1.2, 10: 0.97, 16: 1.3, 24: 0.9, 96: 0.8}, 24),  # a win that does not make up for the loss above it
    ({8: 1.5, 32: 0.9, 48: 0.88, 96: 1.02, 256: 0.85}, 32),  # one count's noise does not make it "never"
    ({8: 1.4, 32: 0.9, 96: 1.0}, 32),  # a tie at the most rows: the win below decides
    ({8: 1.4, 32: 1.0, 96: 1.0}, None),  # ties only: tiles stay whole (never)
    ({8: 1.4, 32: 0.95, 96: 1.1}, None),  # the loss at the most rows outweighs the win: never
])
def test_chunks_start_where_they_make_the_measured_rows_fastest(ratios, expected):
    assert cpu_tuning.choose(ratios) == expected


@pytest.fixture
def avx2_library(monkeypatch):
    """The loaded kernels of the avx2 set (every x86-64 CPU the suite runs on has AVX2), its settings restored
    after the test."""
    choice = _choose("avx2", monkeypatch)
    next(choice)
    lib = cpu_native.selection().library
    before = cpu_tuning.chunk_rows_of(lib)
    yield lib
    cpu_tuning.set_chunk_rows(lib, before)
    next(choice, None)  # the choice made again for the next test


def test_only_the_avx2_builds_have_two_ways(native_kernel_set):
    assert cpu_tuning.has_chunks(cpu_native.selection().library) == native_kernel_set.startswith("avx2")


def test_a_build_with_one_way_measures_and_records_nothing(tmp_path):
    one_way = types.SimpleNamespace(kunlun_gemm_chunk_rows=lambda bf16: -1)  # as the AVX-512 builds answer
    older = types.SimpleNamespace()  # a build from before the choice was measured
    for lib in (one_way, older):
        assert cpu_tuning.apply(lib, tmp_path / "kunlun_cpu.so", lambda lib, kind: pytest.fail("measured")) is None
    assert not list(tmp_path.iterdir())


def _clock_of_the_way(lib, position: int, seen: list[int]):
    """A clock whose every second reading (a run's end) moves on by the time given to the way the library is set
    to: in chunks (an even row count) 2 s below 16 rows and 0.5 s from there, whole (an odd one) 1 s."""
    now = 0.0

    def clock() -> float:
        nonlocal now
        setting = lib.kunlun_gemm_chunk_rows(position)
        seen.append(setting)
        if len(seen) % 2 == 0:
            now += 1.0 if setting % 2 else (2.0 if setting < 16 else 0.5)
        return now

    return clock


def test_the_measurement_times_the_two_ways_the_library_runs(avx2_library, monkeypatch):
    """A clock that sees the library's setting at each reading: the runs in chunks (set to the row count) are
    made to take 2 s below 16 rows and 0.5 s from there, the whole runs (one row more) 1 s; the ratios and the
    choice follow."""
    monkeypatch.setattr(cpu_tuning, "LAYER_SHAPES", ((40, 32), (24, 64)))
    monkeypatch.setattr(cpu_tuning, "WEIGHT_BYTES", 1)
    lib = avx2_library
    for kind, position in (("float32", 0), ("bfloat16", 1)):
        seen = []
        clock = _clock_of_the_way(lib, position, seen)
        other = lib.kunlun_gemm_chunk_rows(1 - position)
        ratios = cpu_tuning.measure(lib, kind, rows_list=(8, 10, 16, 24), turns=3, clock=clock)
        assert ratios == {8: 2.0, 10: 2.0, 16: 0.5, 24: 0.5}
        assert cpu_tuning.choose(ratios) == 16
        # per row count: a warm-up, then three turns of both ways, each way first in turn; the other kind kept
        assert seen[:14] == [8, 8, 8, 8, 9, 9, 9, 9, 8, 8, 8, 8, 9, 9]
        assert len(seen) == 4 * 14
        assert lib.kunlun_gemm_chunk_rows(1 - position) == other


def test_the_choice_is_measured_once_recorded_and_set_into_the_library(avx2_library, monkeypatch, tmp_path):
    lib = avx2_library
    library_path = tmp_path / "kunlun_cpu-avx2-test.so"
    measured = []

    def fake_measure(lib, kind):
        measured.append(kind)
        return {8: 1.3, 16: 1.1, 32: 0.9, 96: 0.8} if kind == "float32" else {8: 1.2, 16: 1.1, 96: 1.05}

    tuning = cpu_tuning.apply(lib, library_path, fake_measure)
    assert measured == ["float32", "bfloat16"]
    assert tuning.chunk_rows == {"float32": 32, "bfloat16": None}
    assert (lib.kunlun_gemm_chunk_rows(0), lib.kunlun_gemm_chunk_rows(1)) == (32, cpu_tuning.NEVER)
    record = json.loads(cpu_tuning.tuning_file(library_path).read_text())
    assert list(record) == [f"{cpu_tuning.cpu_model()}, {torch.get_num_threads()} threads"]

    lib.kunlun_gemm_set_chunk_rows(0, 0)  # a fresh load: the compiled defaults, then the record
    assert cpu_tuning.apply(lib, library_path, fake_measure) == tuning
    assert measured == ["float32", "bfloat16"]  # read, not measured again
    assert (lib.kunlun_gemm_chunk_rows(0), lib.kunlun_gemm_chunk_rows(1)) == (32, cpu_tuning.NEVER)

    monkeypatch.setattr(cpu_tuning, "PROCEDURE", cpu_tuning.PROCEDURE + 1)  # measured and chosen another way now
    cpu_tuning.apply(lib, library_path, fake_measure)
    assert measured == ["float32", "bfloat16"] * 2

    monkeypatch.setattr(cpu_tuning, "cpu_model", lambda: "another CPU")  # a shared cache on another machine
    cpu_tuning.apply(lib, library_path, fake_measure)
    assert measured == ["float32", "bfloat16"] * 3
    assert len(json.loads(cpu_tuning.tuning_file(library_path).read_text())) == 2


def test_the_selection_says_what_this_cpu_measured_and_the_plugins_stack_stays_the_same(avx2_library, monkeypatch,
                                                                                      tmp_path, caplog):
    """A fresh cache: once the kernels are loaded (and measured), the selection's reason (what the benchmarks
    record) and the log give the choice; the ops plugin's stack, which the version matrix compares between doctor
    runs, names the set and why before and after alike."""
    kernel_set = cpu_native.selection().kernel_set
    built = cpu_native._target(cpu_native.compiler()[1], kernel_set)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    shutil.copy(built, cpu_native._target(cpu_native.compiler()[1], kernel_set))  # the same build, not measured
    monkeypatch.setattr(cpu_tuning, "measure", lambda lib, kind: {8: 1.2, 48: 0.9, 96: 0.9})
    before = cpu_native.describe_planned()
    assert before.startswith("avx2 (") and "GEMM tiles" not in before
    cpu_native.load.__wrapped__(kernel_set)
    measured = "GEMM tiles in chunks: float32 from 48 rows, bfloat16 from 48 rows (measured on this CPU)"
    with caplog.at_level(logging.INFO, logger=cpu_native.log.name):
        assert cpu_native.selection.__wrapped__().reason.endswith(measured)
    assert measured in caplog.text
    assert cpu_native.describe_planned() == before
