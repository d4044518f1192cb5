"""Pipeline stages give the tokens of transformers, however they are started, and fail like tensor-parallel ranks.

Every spawned world costs seconds on a small machine, so each engine here
checks several things at once: the tokens (against transformers), the KV
cache given back, the workers gone.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import pytest
import torch

from kunlun_infer import LLM, ConfigError, SamplingParams, WorkerError
from kunlun_infer.capabilities import Comm, has_point_to_point
from kunlun_infer.hookspecs import PluginInfo, hookimpl
from kunlun_infer.engine.parallel.placement import free_loopback_port
from kunlun_infer.engine.parallel.stages import Grid, split_layers
from kunlun_infer.plugins.cpu_comm import GlooComm
from tests.engine.tiny_models import build_tiny_model, hf_greedy
from tests.parallel.conftest import overrides
from tests.parallel.test_failures import TIMEOUT_S, gone, my_workers, steps_until_worker_error
from tests.platforms import require_simchip
from tests.parallel.test_tensor_parallel import TEXT_PROMPTS, generate_command, json_tokens, prompts, run_all

MAX_TOKENS = 8
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
SCORED = SamplingParams(max_tokens=4, temperature=0, logprobs=2, prompt_logprobs=1)


def pp(stages: int, tensor_size: int = 1, *extra: str, **keys) -> list[str]:
    return overrides(tensor_size, **keys) + [f"parallel.pipeline_size={stages}", *extra]


@pytest.fixture(scope="module")
def references(tiny_model):
    import transformers as tf

    cache: dict[Any, list[list[int]]] = {}

    def get(folder, batch=None):
        key = (str(folder), None if batch is None else str(batch))
        if key not in cache:
            hf = tf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
            cache[key] = [hf_greedy(hf, p, MAX_TOKENS) for p in (prompts() if batch is None else batch)]
        return cache[key]

    return get


@pytest.fixture(scope="module")
def four_layers(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("pp-llama4"), "llama", num_hidden_layers=4)


# ---------------------------------------------------------------------- the split


def test_layers_split_evenly_or_as_asked_and_a_bad_split_names_the_key():
    assert split_layers(24, 2) == (12, 12)
    assert split_layers(10, 3) == (3, 3, 4)  # the last stages take the remainder
    assert split_layers(24, 2, [10, 14]) == (10, 14)
    for bad in ([10, 10], [24, 0], [8, 8, 8]):
        with pytest.raises(ConfigError, match=r"parallel.pipeline_layers=.* add up to the model's 24 layers"):
            split_layers(24, 2, bad)
    with pytest.raises(ConfigError, match="parallel.pipeline_size=5 is more stages than the model's 4 layers"):
        split_layers(4, 5)
    grid = Grid(2, 2, (1, 3))
    assert grid.describe().splitlines() == ["stage 0: embedding, layers 0-0 (1 layers) on ranks 0, 1",
                                            "stage 1: layers 1-3, norm + LM head (3 layers) on ranks 2, 3"]
    assert [grid.prev_rank(r) for r in range(4)] == [None, 0, 0, 1]
    assert [grid.next_rank(r) for r in range(4)] == [2, 3, None, None]


# ---------------------------------------------------------------------- tokens


@pytest.mark.parametrize("arch,platform", [("llama", "cpu"), ("qwen2", "cpu"), ("qwen3", "cpu"),
                                           ("llama", "simchip"), ("deepseek_v3", "cpu")])
def test_two_stages_generate_the_tokens_of_transformers(arch, platform, tiny_model, references):
    if platform == "simchip":
        require_simchip()  # its tensors are host tensors underneath: gloo passes them between stages
    folder = tiny_model(arch)  # qwen2: tied embeddings, so the last stage reads the embedding as its head
    with LLM(model=str(folder), overrides=pp(2, 1, f"platform={platform}")) as llm:
        assert llm.config.comm.name == "gloo" and len(my_workers()) == 1
        assert llm.engine.runner.model.lm_head is None  # rank 0 holds the first stage only
        got = [o.token_ids for o in llm.generate(prompts(), GREEDY, use_tqdm=False)]
        scored = None
        if (arch, platform) == ("llama", "cpu"):  # the logits that come back are the whole model's, to the bit
            scored = llm.generate(prompts()[1:3], SCORED, use_tqdm=False)
        stats = llm.engine.stats()
    assert got == references(folder)
    if scored is not None:
        with LLM(model=str(folder), overrides=overrides(1)) as one:
            alone = one.generate(prompts()[1:3], SCORED, use_tqdm=False)
        assert [(o.logprobs, o.prompt_logprobs) for o in scored] == [(o.logprobs, o.prompt_logprobs) for o in alone]
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert my_workers() == []


def test_two_stages_of_two_ranks_with_prefix_caching_preemption_and_n_samples(tiny_model, references):
    folder = tiny_model("qwen3")
    shared = list(range(40, 90))
    batch = [shared + [7, 8, 9], shared + [1, 2], *prompts()[:3]]
    # 12 blocks of 16 tokens: the prompts do not all fit with their outputs, so sequences are preempted
    with LLM(model=str(folder), overrides=pp(2, 2, cache__num_blocks=12, cache__prefix_caching=True)) as llm:
        assert len(my_workers()) == 3
        outs = llm.generate(batch, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, n=2), use_tqdm=False)
        hits_before = llm.engine.stats()["prefix_cache_hit_tokens"]
        again = llm.generate([shared + [4, 4]], GREEDY, use_tqdm=False)  # the shared prefix is cached by now
        stats = llm.engine.stats()
    expected = references(folder, batch + [shared + [4, 4]])
    assert [o.token_ids for o in outs] == [e for e in expected[:-1] for _ in range(2)]  # n=2: both samples
    assert again[0].token_ids == expected[-1]
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hit_tokens"] - hits_before >= 48
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert my_workers() == []


def test_two_batches_in_flight_hold_different_sequences_and_the_tightest_stage_sizes_the_cache(four_layers,
                                                                                               references):
    batch = prompts()[:4] + [[3, 1, 4, 1, 5]]
    with LLM(model=str(four_layers), overrides=pp(2, 1, "parallel.pipeline_layers=[1,3]",
                                                 scheduler__max_num_seqs=4, cache__memory_fraction=0.5)) as llm:
        engine = llm.engine
        budget = engine.kv_budget
        per_block = [m[2] for m in engine.parallel.rank_memory]
        assert per_block[1] == 3 * per_block[0]  # each stage holds KV for its own layers only
        assert budget.bytes_per_block == per_block[1]  # and the one with three layers decides
        submits = []  # at each submit: the new batch's sequences, and those of the batches still in flight
        submit = engine.runner.submit

        def spy(scheduled, *args):
            submits.append(({s.seq_id for s in scheduled.seqs},
                            [{s.seq_id for s in b.seqs} for b, _ in engine._in_flight]))
            return submit(scheduled, *args)

        engine.runner.submit = spy
        doomed = engine.add_request(list(range(30)), GREEDY)
        ids = [engine.add_request(p, GREEDY) for p in batch]
        engine.step()
        assert doomed in {s.request_id for b, _ in engine._in_flight for s in b.seqs}
        engine.abort(doomed)  # while its step is in the pipeline: its blocks come back, its tokens are dropped
        finished: dict[str, Any] = {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out
        stats = engine.stats()
    assert [finished[i].token_ids for i in ids] == references(four_layers, batch)
    assert finished[doomed].finish_reason == "abort" and finished[doomed].token_ids == []
    overlapping = [(new, flying) for new, flying in submits if flying]
    assert len(overlapping) > len(submits) // 2  # most batches went in while another was in the pipeline
    assert all(not new & seqs for new, flying in submits for seqs in flying)  # never one sequence twice
    assert max(len(new) for new, _ in submits) == 2  # each batch takes its share of scheduler.max_num_seqs
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_plan_prints_the_split_and_sizes_the_cache_by_the_tightest_stage(four_layers, capsys):
    from kunlun_infer.cli import main

    split = [f"model.path={four_layers}", "parallel.pipeline_size=2", "device_memory=64MiB",
             "model.max_model_len=512", "scheduler.max_num_seqs=1024"]
    assert main(["plan", *split, "parallel.pipeline_layers=[1,3]"]) == 0
    out = capsys.readouterr().out
    assert "stage 0: embedding, layers 0-0 (1 layers) on rank 0" in out
    assert "stage 1: layers 1-3, norm + LM head (3 layers) on rank 1" in out
    blocks = [int(line.rsplit("room for ", 1)[1].split()[0]) for line in out.splitlines() if "room for" in line]
    assert blocks[0] > 2 * blocks[1]  # three layers' KV per block leave room for fewer blocks
    assert f"KV blocks: {blocks[1]} " in out  # the engine's count: the tightest stage's
    assert main(["plan", *split, "parallel.pipeline_layers=[1,2]"]) != 0
    assert "parallel.pipeline_layers=[1, 2] must give each of the 2 stages" in capsys.readouterr().err


# ---------------------------------------------------------------------- a comm of hook API 1.3


class CommBefore14(Comm):
    """A comm plugin's class as written for hook API 1.3: collectives, no send/recv/subgroup."""

    name = "gloo-1.3"

    def __init__(self) -> None:
        self.gloo = GlooComm()

    def init(self, *, rank, world_size, init_method=None, timeout_s=30.0):
        self.gloo.init(rank=rank, world_size=world_size, init_method=init_method, timeout_s=timeout_s)
        self.rank, self.world_size = rank, world_size

    def all_reduce(self, tensor, accumulate_dtype=None):
        return self.gloo.all_reduce(tensor, accumulate_dtype)

    def all_gather(self, tensor, dim=-1):
        return self.gloo.all_gather(tensor, dim)

    def broadcast(self, tensor, src=0):
        return self.gloo.broadcast(tensor, src)

    def broadcast_object(self, obj, src=0):
        return self.gloo.broadcast_object(obj, src)

    def barrier(self):
        self.gloo.barrier()

    def destroy(self):
        self.gloo.destroy()


class PluginBefore14:
    """A comm plugin of hook API 1.3's day, registered like any other."""

    @hookimpl
    def kunlun_infer_plugin_info(self):
        return PluginInfo(name="old-comm", version="0.9.0", api=">=1.0,<2", capabilities=("comm",))

    @hookimpl
    def kunlun_infer_comm_factories(self):
        return {"gloo-1.3": lambda *, config, device: CommBefore14()}


def test_a_comm_plugin_written_for_hook_api_1_3_loads_reduces_and_is_refused_for_a_pipeline_by_name(tiny_model):
    from kunlun_infer import compose_config
    from kunlun_infer.engine.engine import LLMEngine
    from kunlun_infer.runtime import PluginManager, Runtime

    manager = PluginManager.load(entry_points=False)
    manager.register(PluginBefore14())
    cfg = compose_config(pp(2, 1, "comm=gloo-1.3", f"model.path={tiny_model('llama')}"), plugin_manager=manager)
    runtimes = [Runtime.from_config(cfg, plugin_manager=manager) for _ in range(2)]
    assert runtimes[0].plugin_for("comm") == "old-comm"
    url = f"tcp://127.0.0.1:{free_loopback_port()}"
    sums: list[Any] = [None, None]

    def rank(r: int) -> None:  # two ranks in threads: the 1.3 plugin's collectives run as they always did
        runtimes[r].init_comm(rank=r, world_size=2, init_method=url)
        sums[r] = runtimes[r].comm.all_reduce(torch.tensor([float(r + 1)])).item()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    try:
        assert sums == [3.0, 3.0]
        assert not has_point_to_point(runtimes[0].comm) and has_point_to_point(GlooComm())
        with pytest.raises(Exception, match=r"comm=gloo-1.3 .* no point-to-point send/recv .*hook API 1.4"):
            runtimes[0].comm.send(torch.zeros(1), 1)
        with pytest.raises(ConfigError, match=r"comm=gloo-1.3 .*pipeline parallelism \(parallel.pipeline_size > 1\)"):
            LLMEngine(cfg, runtime=runtimes[0])  # refused before any rank is started
        assert my_workers() == []
    finally:
        for rt in runtimes:
            rt.close()


# ---------------------------------------------------------------------- failures


@pytest.mark.parametrize("how", ["killed", "stopped"])
def test_a_stage_that_dies_or_hangs_mid_generation_raises_worker_error(how, tiny_model):
    llm = LLM(model=str(tiny_model("llama")), overrides=pp(2) + [f"comm.timeout_s={TIMEOUT_S}"])
    try:
        (pid,) = llm.engine.parallel.workers.pids
        if how == "killed":  # idle past the timeout first: heartbeats travel the chain and keep the stage waiting
            time.sleep(TIMEOUT_S * 1.5)
        requests = [llm.engine.add_request(list(range(1, 20 + k)), SamplingParams(max_tokens=400, temperature=0,
                                                                                  ignore_eos=True))
                    for k in range(4)]
        for _ in range(4):
            llm.engine.step()
        os.kill(pid, signal.SIGKILL if how == "killed" else signal.SIGSTOP)
        error, waited = steps_until_worker_error(llm)
        assert waited < TIMEOUT_S + 4
        if how == "killed":
            assert f"pid {pid}" in str(error) and "SIGKILL" in str(error)
        else:
            assert "did not answer" in str(error) and f"comm.timeout_s={TIMEOUT_S}" in str(error)
        assert not any(r in llm.engine._requests for r in requests)  # every batch in flight was ended
        stats = llm.engine.stats()
        assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
        llm.engine.add_request([1, 2, 3], GREEDY)
        with pytest.raises(WorkerError, match="start a new one"):
            while llm.engine.has_unfinished():
                llm.engine.step()
    finally:
        llm.close()
    assert gone([pid]) and my_workers() == []


# ---------------------------------------------------------------------- torchrun


def test_torchrun_one_host_two_hosts_on_loopback_and_four_ranks_generate_the_embedded_tokens(tiny_model):
    folder = tiny_model("llama")
    with LLM(model=str(folder), overrides=overrides(1)) as llm:
        embedded = [o.token_ids for o in llm.generate(TEXT_PROMPTS, GREEDY, use_tqdm=False)]
    stages = ["parallel.pipeline_size=2"]
    (one_host,) = run_all([generate_command(folder, ["--standalone", "--nproc-per-node", "2"]) + stages])
    assert json_tokens(one_host) == embedded
    # four ranks: two stages of two tensor-parallel ranks (parallel.tensor_size follows from the world)
    (grid,) = run_all([generate_command(folder, ["--standalone", "--nproc-per-node", "4"]) + stages])
    assert json_tokens(grid) == embedded
    endpoint = f"127.0.0.1:{free_loopback_port()}"
    hosts = [generate_command(folder, ["--nnodes", "2", "--node-rank", str(k), "--nproc-per-node", "1",
                                       "--rdzv-endpoint", endpoint]) + stages for k in (0, 1)]
    host0, host1 = run_all(hosts)
    assert json_tokens(host0) == embedded  # rank 0 (host 0) runs the first stage, drives and prints
    assert host1.returncode == 0 and json_tokens(host1) == []  # rank 1 runs the last stage silently


def test_stages_capture_the_listed_sizes_at_start_and_replay_them_with_the_eager_steps_tokens(four_layers):
    from tests.engine.test_step_graph_sizes import assert_same_results

    # ops.step_graph_sizes: rank 0 tells every stage to capture them when the engine starts, as it does its own
    batch = prompts()[:3]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=1) for n in (3, 6, 9)]

    def run(*extra):
        with LLM(model=str(four_layers), overrides=pp(2, 1, *extra)) as llm:
            at_start = llm.engine.runner.graphs and llm.engine.runner.graphs.batch_sizes
            outs = llm.generate(batch, params, use_tqdm=False)
            replays = llm.engine.runner.graphs.replays if llm.engine.runner.graphs else 0
        return [(o.token_ids, o.logprobs) for o in outs], at_start, replays

    eager, _, _ = run("ops.step_graphs=0")
    replayed, at_start, replays = run("ops.step_graph_sizes=[1,2,4]")
    assert at_start == [1, 2, 4] and replays >= 6
    assert_same_results(replayed, eager)  # a padded step's GEMMs take one more row: logprobs to 1e-4
    assert my_workers() == []
