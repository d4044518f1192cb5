"""``kunlun-infer bench``: workloads, measured figures, sweeps with a knee, JSON and PNG."""

from __future__ import annotations

import json

import pytest

from kunlun_infer.errors import ConfigError
from kunlun_infer.tools.bench.knee import find_knee, marginal_gains
from kunlun_infer.tools.bench.run import percentiles, run_workload, warm_up
from kunlun_infer.tools.bench.workload import LengthRange, jsonl_workload, synthetic_workload
from kunlun_infer.tools.tiny_model import VOCAB_SIZE

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------------ the knee


def test_knee_where_more_batch_stops_buying_throughput():
    values = [1, 2, 4, 8, 16, 32, 64]
    throughput = [100, 195, 370, 640, 860, 905, 915]  # saturates from 16 on
    assert values[find_knee(values, throughput)] == 16
    assert values[find_knee(values, throughput, fraction=1.0)] == 64  # only the best reaches 100 %
    assert values[find_knee(values, throughput, fraction=0.5)] == 8


def test_knee_ignores_a_dip_before_the_curve_flattens():
    values = [1, 2, 4, 8, 16]
    throughput = [100, 190, 185, 600, 640]  # a noisy dip at 4 is not a plateau
    assert values[find_knee(values, throughput)] == 8


def test_knee_of_unsorted_values_and_of_a_falling_curve():
    assert find_knee([8, 1, 4, 2], [50, 100, 60, 80]) == 1  # the best is the smallest value
    assert find_knee([3], [7.0]) == 0
    with pytest.raises(ValueError):
        find_knee([1, 2], [1.0])


def test_marginal_gains_follow_ascending_values():
    gains = marginal_gains([4, 1, 2], [300.0, 100.0, 150.0])
    assert gains[1] is None and gains[2] == pytest.approx(0.5) and gains[0] == pytest.approx(1.0)


def test_percentiles_interpolate():
    p = percentiles([float(i) for i in range(1, 101)])
    assert p["p50"] == pytest.approx(50.5) and p["p90"] == pytest.approx(90.1) and p["p99"] == pytest.approx(99.01)
    assert percentiles([]) == {"p50": None, "p90": None, "p99": None}


# ------------------------------------------------------------------ workloads


def test_synthetic_workload_is_seeded_and_within_its_ranges():
    make = lambda seed: synthetic_workload(20, LengthRange.parse("4:9"), LengthRange.parse("3"), vocab_size=50,
                                           seed=seed)
    a, b, c = make(1), make(1), make(2)
    assert a == b and a != c
    assert all(4 <= len(r.prompt) <= 9 and r.max_tokens == 3 for r in a.requests)
    assert all(0 <= t < 50 for r in a.requests for t in r.prompt)
    assert len({len(r.prompt) for r in a.requests}) > 1


@pytest.mark.parametrize("text", ["0", "9:4", "x", "4:"])
def test_bad_lengths_are_refused(text):
    with pytest.raises(ConfigError, match="input_len"):
        LengthRange.parse(text, what="input_len")


def test_jsonl_workload(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "hello"}\n\n{"prompt_token_ids": [1, 2, 3], "max_tokens": 5}\n')
    workload = jsonl_workload(path, LengthRange(7, 7))
    assert [(r.prompt, r.max_tokens) for r in workload.requests] == [("hello", 7), ([1, 2, 3], 5)]
    path.write_text('{"text": "no prompt key"}\n')
    with pytest.raises(ConfigError, match="line 1"):
        jsonl_workload(path, LengthRange(7, 7))


# ------------------------------------------------------------------ the command


def test_bench_measures_a_synthetic_workload(cli, tiny_model):
    result = cli("bench", f"model.path={tiny_model}", "model.max_model_len=256", "num_prompts=12",
                 "input_len=8:24", "output_len=6", "--no-progress", "--json")
    assert result.code == 0, result.err
    data = result.json()
    assert data["num_requests"] == 12 and data["output_tokens"] == 12 * 6
    assert 12 * 8 <= data["input_tokens"] <= 12 * 24
    assert data["output_tokens_per_s"] == pytest.approx(data["output_tokens"] / data["elapsed_s"])
    for key in ("ttft_s", "per_token_s"):
        assert 0 < data[key]["p50"] <= data[key]["p90"] <= data[key]["p99"]
    assert 0 < data["kv_utilization_peak"] <= 1 and data["kv_utilization_mean"] <= data["kv_utilization_peak"]
    assert data["peak_memory"] == data["weight_bytes"] + data["allocator_peak"] and data["allocator_peak"] > 0
    assert data["warmup_s"] > 0
    cold = cli("bench", f"model.path={tiny_model}", "model.max_model_len=256", "num_prompts=3", "input_len=8",
               "output_len=2", "--no-progress", "--no-warmup", "--json")
    assert cold.code == 0, cold.err
    assert cold.json()["warmup_s"] is None and cold.json()["output_tokens"] == 6


def test_the_warm_up_does_the_one_time_work_and_leaves_no_prefix_to_the_measured_run(tiny_model):
    """Decode steps are captured once per batch size (the CPU plugin too): after the warm-up the measured run
    captures nothing and finds none of its prompts cached; measured from cold, it captures them itself."""
    from kunlun_infer.engine.engine import LLMEngine
    from kunlun_infer.runtime import compose_config

    cfg = compose_config([f"model.path={tiny_model}", "model.max_model_len=256", "scheduler.max_num_seqs=8"])
    workload = synthetic_workload(12, LengthRange(8, 24), LengthRange(2, 9), vocab_size=VOCAB_SIZE, seed=0)
    captures = {}
    for warm in (True, False):
        engine = LLMEngine(cfg)
        try:
            graphs = engine.runner.graphs
            assert graphs is not None and graphs.captures == 0
            seconds = warm_up(engine, workload) if warm else None
            before, stats = graphs.captures, engine.stats()
            result = run_workload(engine, workload, warmup=False)
            captures[warm] = graphs.captures - before
            assert engine.stats()["prefix_cache_hit_tokens"] == stats["prefix_cache_hit_tokens"]
            assert result.output_tokens == sum(r.max_tokens for r in workload.requests)
            if warm:
                assert seconds > 0 and before > 0
        finally:
            engine.close()
    assert captures == {True: 0, False: captures[False]} and captures[False] > 0


def test_bench_reads_prompts_from_jsonl_and_prints_a_summary(cli, tiny_model, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": f"question {i}?", "max_tokens": 4}) for i in range(5)))
    result = cli("bench", f"model.path={tiny_model}", "model.max_model_len=256", f"prompts_file={prompts}",
                 "--no-progress", "--out", tmp_path / "out")
    assert result.code == 0, result.err
    assert "requests: 5 in" in result.out
    assert "warm-up: 5 requests of the same lengths, untimed, in " in result.out
    assert "time to first token: p50 " in result.out and "KV cache utilization: peak" in result.out
    saved = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert saved["output_tokens"] == 20 and saved["input_tokens"] == 5 * len("question 0?")


def test_bench_sweep_finds_the_knee_and_writes_json_and_png(cli, tiny_model, tmp_path):
    out = tmp_path / "sweep"
    result = cli("bench", f"model.path={tiny_model}", "model.max_model_len=256", "num_prompts=16", "input_len=16",
                 "output_len=8", "--sweep", "scheduler.max_num_seqs=1,4,16", "--out", out, "--no-progress")
    assert result.code == 0, result.err
    sweep = json.loads((out / "bench-sweep.json").read_text())
    assert sweep["key"] == "scheduler.max_num_seqs" and [p["value"] for p in sweep["points"]] == [1, 4, 16]
    throughput = [p["output_tokens_per_s"] for p in sweep["points"]]
    knee = sweep["knee"]
    assert knee["value"] == [1, 4, 16][find_knee([1, 4, 16], throughput)]
    assert throughput[knee["index"]] >= 0.9 * max(throughput)
    assert all(p["output_tokens"] == 16 * 8 for p in sweep["points"])
    assert throughput[2] > throughput[0]  # batching 16 sequences beats one at a time
    png = (out / "bench-sweep.png").read_bytes()
    assert png.startswith(PNG_MAGIC) and len(png) > 10_000
    assert f"knee (*): scheduler.max_num_seqs={knee['value']}" in result.out
    assert f"{knee['value']} *" in result.out  # the starred table row


def test_bench_sweep_of_an_unknown_key_is_one_line(cli, tiny_model, tmp_path):
    result = cli("bench", f"model.path={tiny_model}", "num_prompts=2", "--sweep", "scheduler.max_num_sequences=1,2",
                 "--out", tmp_path, "--no-progress")
    assert result.code == 2
    assert "scheduler.max_num_sequences" in result.err and result.err.count("\n") == 1


def test_bench_flag_errors(cli):
    assert cli("bench", "--sweep", "scheduler.max_num_seqs").code == 2
    assert cli("bench", "knee=1.5").code == 2
