"""Captured decode steps (``ops.step_graphs``, hook API 1.5) give the eager steps' results, bit for bit.

The ``cpu`` ops capture the first decode step of each batch size and replay
its native kernels after that. A workload whose batch shrinks and grows
(requests of different lengths, some arriving late, prompts across block
boundaries) must produce the same tokens and the same logprobs as the same
workload run eagerly — in float32 and in bf16, on Llama (GQA) and Qwen2 (qkv
bias, tied embeddings). What cannot be captured runs eagerly and says why.
"""

import pytest
import torch

from kunlun_infer import SamplingParams
from kunlun_infer.plugins import cpu_native

pytestmark = pytest.mark.skipif(cpu_native.library() is None, reason="the native CPU kernels do not build here")


def workload(llm) -> list[tuple[list[int], list]]:
    """Nine requests finishing at different steps, three more joining late; tokens and logprobs of each."""
    g = torch.Generator().manual_seed(3)
    engine = llm.engine
    ids = []
    for i, n in enumerate([1, 15, 16, 17, 33, 70, 5, 40, 9]):
        params = SamplingParams(max_tokens=4 + 3 * i, temperature=0.8 if i % 2 else 0.0, seed=i, logprobs=2,
                                ignore_eos=True)
        ids.append(engine.add_request(torch.randint(0, 256, (n,), generator=g).tolist(), params))
    finished: dict[str, tuple[list[int], list]] = {}
    steps = 0
    while engine.has_unfinished() or len(ids) < 12:
        if steps == 6:
            for n in (3, 18, 31):
                ids.append(engine.add_request(torch.randint(0, 256, (n,), generator=g).tolist(),
                                              SamplingParams(max_tokens=12, temperature=0.0, logprobs=1,
                                                             ignore_eos=True)))
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = (list(out.token_ids), list(out.logprobs))
        steps += 1
    return [finished[i] for i in ids]


@pytest.mark.parametrize("arch,dtype", [("llama", "float32"), ("qwen2", "float32"), ("qwen2", "bfloat16")])
def test_replayed_steps_equal_eager_steps(arch, dtype, tiny_model, make_llm):
    eager = make_llm(tiny_model(arch), model__dtype=dtype, ops__step_graphs=0)
    graphs = make_llm(tiny_model(arch), model__dtype=dtype)
    assert eager.engine.runner.graphs is None
    want = workload(eager)
    got = workload(graphs)
    assert got == want
    captured = graphs.engine.runner.graphs
    assert captured.refused == {}
    assert len(captured.batch_sizes) >= 5  # the batch shrank and grew through many sizes
    assert captured.replays > 2 * captured.captures  # most decode steps were replays
    stats = graphs.engine.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_batches_above_the_limit_run_eagerly(tiny_model, make_llm):
    llm = make_llm(tiny_model("llama"), ops__step_graphs=2)
    prompts = [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10]]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    got = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    want = [o.token_ids for o in make_llm(tiny_model("llama"), ops__step_graphs=0).generate(prompts, params,
                                                                                            use_tqdm=False)]
    assert got == want
    assert llm.engine.runner.graphs.batch_sizes == []  # four sequences decode together: above the limit


def test_what_the_plugin_cannot_capture_runs_eagerly_and_says_why(tiny_model, make_llm):
    # the mixture-of-experts layers route tokens in torch: the capture is refused, naming the op
    moe = make_llm(tiny_model("qwen3_moe"))
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    got = [o.token_ids for o in moe.generate([[1, 2, 3], [4, 5, 6, 7]], params, use_tqdm=False)]
    graphs = moe.engine.runner.graphs
    assert graphs.batch_sizes == [] and graphs.replays == 0
    assert set(graphs.refused) == {2}
    eager = make_llm(tiny_model("qwen3_moe"), ops__step_graphs=0)
    assert got == [o.token_ids for o in eager.generate([[1, 2, 3], [4, 5, 6, 7]], params, use_tqdm=False)]
    # the plain-torch op table does not capture at all
    plain = make_llm(tiny_model("llama"), ops="torch")
    plain.generate([[1, 2, 3]], params, use_tqdm=False)
    assert plain.engine.runner.graphs.refused == {1: "the ops plugin did not capture it"}


def test_a_new_kv_cache_drops_the_captures(tiny_model, make_llm):
    llm = make_llm(tiny_model("llama"))
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    first = [o.token_ids for o in llm.generate([[1, 2, 3]], params, use_tqdm=False)]
    runner = llm.engine.runner
    assert runner.graphs.batch_sizes == [1]
    runner.resize_kv_cache(len(runner.kv_caches[0][0]))  # a new cache: the captured pointers would dangle
    assert runner.graphs.batch_sizes == []
    assert [o.token_ids for o in llm.generate([[1, 2, 3]], params, use_tqdm=False)] == first
    assert runner.graphs.batch_sizes == [1]


def test_a_failed_replay_runs_the_step_eagerly(tiny_model, make_llm, monkeypatch):
    from kunlun_infer.plugins import cpu_capture

    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    want = [o.token_ids for o in make_llm(tiny_model("llama"), ops__step_graphs=0).generate(
        [[1, 2, 3], [9, 8]], params, use_tqdm=False)]

    def fail(self):
        raise cpu_capture.ReplayError("a captured kernel (kunlun_store_kv) returned status -2")

    monkeypatch.setattr(cpu_capture.CapturedStep, "replay", fail)
    llm = make_llm(tiny_model("llama"))
    assert [o.token_ids for o in llm.generate([[1, 2, 3], [9, 8]], params, use_tqdm=False)] == want
    graphs = llm.engine.runner.graphs
    assert graphs.captures >= 1 and graphs.replays == 0  # every later step fell back to the eager forward


@pytest.mark.parametrize("arch,dtype,sizes", [("llama", "float32", None), ("qwen2", "bfloat16", [2, 5, 16]),
                                               ("qwen3", "float32", None)])
def test_pipeline_stages_replay_their_own_layers_as_their_eager_steps_run_them(arch, dtype, sizes, tiny_model,
                                                                               make_llm):
    """A two-stage split of the model in one process, beside a one-rank engine's workload: the first stage
    captures from the embedding to the ``(hidden, residual)`` it sends on, the second from what it receives; their
    replays give the eager stages' outputs bit for bit, which are the whole model's. What a stage cannot capture
    (a norm left to the torch reference) runs eagerly, and the refusal is no failure of the step on a rank that
    holds its kernels' failures back. With ``ops.step_graph_sizes`` both stages capture every size at start, and
    a step runs padded in the next larger one."""
    from kunlun_infer.engine.model_runner import ModelRunner
    from kunlun_infer.engine.parallel.stages import Grid, split_layers
    from kunlun_infer.engine.step_graph import StepGraphs
    from kunlun_infer.models import load_model
    from kunlun_infer.runtime import Runtime

    llm = make_llm(tiny_model(arch), model__dtype=dtype, ops__step_graphs=0)
    engine = llm.engine
    num_blocks = engine.stats()["kv_blocks_total"]
    grid = Grid(2, 1, split_layers(engine.model_config.num_hidden_layers, 2))
    runtimes = []

    def stage(index: int, graphs: bool) -> ModelRunner:
        rt = Runtime.from_config(engine.config)  # a rank's own: its op table holds back its model's failures
        runtimes.append(rt)
        model = load_model(engine.model_path, runtime=rt, dtype=engine.dtype, max_model_len=engine.max_model_len,
                           span=grid.span(index), defer_failures=True)  # as a pipeline rank loads its stage
        runner = ModelRunner(model, device=engine.device, block_size=engine.block_size, sampler=None,
                             memory=rt.memory)
        if graphs:
            runner.graphs = StepGraphs(rt.capture_step, model, model.attention, max_batch=16,
                                       max_blocks=-(-engine.max_model_len // engine.block_size), sizes=sizes,
                                       stage_dtype=engine.dtype if index else None)
        runner.resize_kv_cache(num_blocks)
        if graphs and sizes:
            assert runner.capture_step_graphs(16) == len(sizes)
        return runner

    eager, replayed = [stage(0, False), stage(1, False)], [stage(0, True), stage(1, True)]
    whole = engine.runner.forward
    checked = []

    def forward(inputs, intermediate=None):
        want = whole(inputs, intermediate)
        outputs = []
        for first, last in (eager, replayed):
            sent = first.forward(inputs)
            outputs.append((tuple(t.clone() for t in sent), last.forward(inputs, sent).clone()))
            assert first.model.deferred_failures.take() is None and last.model.deferred_failures.take() is None
        (eager_sent, eager_out), (replayed_sent, replayed_out) = outputs
        checked.append(all(torch.equal(a, b) for a, b in zip(eager_sent, replayed_sent))
                       and torch.equal(eager_out, replayed_out) and torch.equal(eager_out, want))
        return want

    engine.runner.forward = forward
    try:
        workload(llm)
        captured = [(r.graphs.batch_sizes, r.graphs.replays, r.graphs.captures, dict(r.graphs.refused))
                    for r in replayed]
    finally:
        for runner in eager + replayed:
            runner.release_kv_cache()
        for rt in runtimes:
            rt.close()
    assert checked and all(checked)
    for batch_sizes, replays, captures, refused in captured:
        if arch == "qwen3":  # its q and k norms of several rows run in torch (left to the reference op)
            assert len(refused) >= 5 and not set(refused) & set(batch_sizes)
        elif sizes is not None:
            assert refused == {} and batch_sizes == sizes and captures == len(sizes) and replays > 10
        else:
            assert refused == {} and len(batch_sizes) >= 5 and replays > 2 * captures
