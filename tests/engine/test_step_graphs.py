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
