"""Captured decode steps at chosen batch sizes (``ops.step_graph_sizes``, hook API 1.6).

With sizes set, only those batch sizes are captured; a decode step of
another size replays the capture of the next larger size, padded with
sequences that store nothing (:meth:`AttentionStep.padded_to`), and its
padding rows are dropped. The built-in ``cpu`` ops run it here: a workload
whose batch shrinks through odd sizes must give the eager run's tokens and
logprobs, capturing only the sizes asked for; a batch above the largest size
runs eagerly. The sizes are captured when the engine starts, from steps of
padding sequences that leave the cache as it was. Also: what ``padded_to``
appends and refuses, how a size is chosen, and the config's range check.
"""

import pytest
import torch

from kunlun_infer import ConfigError, SamplingParams, compose_config
from kunlun_infer.engine.step_graph import StepGraphs
from kunlun_infer.ops.attention_step import AttentionStep
from kunlun_infer.plugins import cpu_native
from kunlun_infer.runtime import PluginManager

native = pytest.mark.skipif(cpu_native.library() is None, reason="the native CPU kernels do not build here")


def run(llm, lengths: list[int], max_tokens: list[int]) -> list[tuple[list[int], list]]:
    """Greedy and seeded sampled requests finishing at different steps: tokens and logprobs of each."""
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]
    params = [SamplingParams(max_tokens=m, temperature=0.7 if i % 3 == 1 else 0.0, seed=i, logprobs=2,
                             ignore_eos=True) for i, m in enumerate(max_tokens)]
    return [(list(o.token_ids), list(o.logprobs)) for o in llm.generate(prompts, params, use_tqdm=False)]


def assert_same_results(got, want) -> None:
    """The same tokens and the same top logprobs; their values within float32 noise. A padded step runs the
    native GEMM over more rows than the eager step, and the CPU GEMM's row kernels differ below four rows, so
    logprobs may move in the last bits (unlike a capture of the step's own size, which is bit for bit)."""
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in want]
    for (_, got_lp), (_, want_lp) in zip(got, want):
        assert [set(d) for d in got_lp] == [set(d) for d in want_lp]
        for g, w in zip(got_lp, want_lp):
            assert all(abs(g[t] - w[t]) < 1e-4 for t in w), (g, w)


@native
def test_padded_replays_equal_eager_steps(tiny_model, make_llm):
    # seven requests: the decode batch runs 7, 6, 5, 4, 3, 2, 1 sequences
    lengths, max_tokens = [1, 15, 16, 17, 70, 33, 5], [3, 9, 20, 5, 12, 30, 7]
    want = run(make_llm(tiny_model("llama"), ops__step_graphs=0), lengths, max_tokens)
    llm = make_llm(tiny_model("llama"), ops__step_graph_sizes="[2,4,8]")
    assert_same_results(run(llm, lengths, max_tokens), want)
    graphs = llm.engine.runner.graphs
    assert graphs.batch_sizes == [2, 4, 8]  # every size met was served by one of these three
    assert graphs.refused == {} and graphs.captures == 3
    assert graphs.replays == 29  # every decode step (the longest request: 29 after its first token); the sizes
    # were captured when the engine started
    stats = llm.engine.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]  # the padding held no blocks


@native
def test_batches_above_the_largest_size_run_eagerly(tiny_model, make_llm):
    # six requests decode together for four steps (above the largest size, 4), then four of them go on
    lengths, max_tokens = [3, 2, 1, 4, 7, 9], [5, 5, 12, 12, 12, 12]
    want = run(make_llm(tiny_model("llama"), ops__step_graphs=0), lengths, max_tokens)
    llm = make_llm(tiny_model("llama"), ops__step_graph_sizes="[4]")
    assert_same_results(run(llm, lengths, max_tokens), want)
    graphs = llm.engine.runner.graphs
    assert graphs.batch_sizes == [4] and graphs.refused == {}
    assert graphs.size_for(5) is None and graphs.size_for(6) is None
    assert graphs.captures == 1 and graphs.replays == 7  # 7 steps of four sequences, captured at the start


@native
def test_the_sizes_are_captured_when_the_engine_starts_and_store_nothing(tiny_model, make_llm):
    llm = make_llm(tiny_model("llama"), ops__step_graph_sizes="[1,3,8]")
    runner = llm.engine.runner
    graphs = runner.graphs
    assert graphs.batch_sizes == [1, 3, 8] and graphs.captures == 3 and graphs.replays == 0  # before any request
    assert all(not t.any() for layer in runner.kv_caches for t in layer)  # the padding stored nothing
    stats = llm.engine.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"] and stats["num_steps"] == 0
    lengths, max_tokens = [4, 20, 9], [6, 3, 8]
    want = run(make_llm(tiny_model("llama"), ops__step_graphs=0), lengths, max_tokens)
    assert_same_results(run(llm, lengths, max_tokens), want)
    assert graphs.captures == 3 and graphs.replays == 7  # decode batches of 3, 3, 2, 2, 2, 1, 1: all replays
    # a new cache drops the captures; capture_step_graphs takes them again
    runner.resize_kv_cache(len(runner.kv_caches[0][0]))
    assert graphs.batch_sizes == [] and runner.capture_step_graphs(8) == 3 and graphs.batch_sizes == [1, 3, 8]
    # only the sizes a batch of scheduler.max_num_seqs sequences can run in: 4 sequences run in the capture of 8
    few = make_llm(tiny_model("llama"), ops__step_graph_sizes="[1,3,8,16]", scheduler__max_num_seqs=4)
    assert few.engine.runner.graphs.batch_sizes == [1, 3, 8]
    # without explicit sizes nothing is captured ahead: the CPU captures each size as it is met
    assert make_llm(tiny_model("llama")).engine.runner.graphs.batch_sizes == []


def test_the_size_serving_a_batch():
    graphs = StepGraphs(lambda fn: None, None, None, max_batch=8, max_blocks=4, sizes=[8, 2, 4, 16, 4, 0])
    assert graphs.sizes == [2, 4, 8]  # sorted, deduplicated, within 1..ops.step_graphs
    assert [graphs.size_for(n) for n in range(1, 10)] == [2, 2, 4, 4, 8, 8, 8, 8, None]
    every = StepGraphs(lambda fn: None, None, None, max_batch=8, max_blocks=4)
    assert [every.size_for(n) for n in (1, 5, 8, 9)] == [1, 5, 8, None]


def test_padded_to_appends_sequences_that_store_nothing():
    step = AttentionStep(16, [1, 1], [5, 40], [[3], [7, 8, 9]], [3 * 16 + 5, 9 * 16 + 8])
    padded = step.padded_to(5)
    assert padded.num_seqs == 5 and padded.is_decode_only and padded.block_size == 16
    assert padded.query_lens == [1] * 5
    assert padded.context_lens == [5, 40, 0, 0, 0]
    assert padded.block_tables == [[3], [7, 8, 9], [0], [0], [0]]
    assert padded.slot_mapping == [3 * 16 + 5, 9 * 16 + 8, -1, -1, -1]
    assert padded.seq_lens == [6, 41, 1, 1, 1] and padded.num_leading_decodes == 5
    assert step.padded_to(2).slot_mapping == step.slot_mapping  # the same size: nothing appended
    assert step.num_seqs == 2 and step.slot_mapping == [3 * 16 + 5, 9 * 16 + 8]  # the step itself unchanged


def test_padded_to_refuses_prompts_and_shrinking():
    with_prompt = AttentionStep(16, [1, 3], [5, 0], [[3], [4]], [3 * 16 + 5, 64, 65, 66])
    with pytest.raises(ValueError, match=r"padded_to\(4\)"):
        with_prompt.padded_to(4)
    decodes = AttentionStep(16, [1, 1, 1], [0, 0, 0], [[1], [2], [3]], [16, 32, 48])
    with pytest.raises(ValueError, match="can only grow"):
        decodes.padded_to(2)


@pytest.fixture(scope="module")
def builtins_only():
    return PluginManager.load(entry_points=False)


@pytest.mark.parametrize("sizes", ["[2,0,8]", "[-1]"])
def test_config_refuses_sizes_below_one(builtins_only, sizes):
    with pytest.raises(ConfigError, match=r"ops\.step_graph_sizes=.* must be null or a list of sizes >= 1"):
        compose_config([f"ops.step_graph_sizes={sizes}"], plugin_manager=builtins_only)


def test_config_takes_sizes_or_null(builtins_only):
    assert compose_config(plugin_manager=builtins_only).ops.step_graph_sizes is None  # the default: every size
    cfg = compose_config(["ops.step_graph_sizes=[1,3]"], plugin_manager=builtins_only)
    assert list(cfg.ops.step_graph_sizes) == [1, 3]
