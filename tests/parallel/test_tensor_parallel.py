"""Two ranks give the tokens of one rank and of transformers, however they are started.

Embedded: ``LLM(..., parallel.tensor_size=2)`` spawns rank 1 itself (and picks
comm=gloo on its own). torchrun: ``torchrun --nproc-per-node 2 -m kunlun_infer
generate``, and two torchrun invocations with ``--nnodes 2`` on loopback
standing in for two hosts. Prompts span a single token, block boundaries and
prefills long enough for the row-parallel all-reduce to be pipelined when the
streams plugin has its own comm stream.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import psutil
import pytest
import torch

from kunlun_infer import LLM, SamplingParams
from kunlun_infer.layers.moe import FusedExperts
from kunlun_infer.plugins import cpu_native
from kunlun_infer.errors import ConfigError
from kunlun_infer.engine.parallel.cores import core_shares
from kunlun_infer.engine.parallel.placement import free_loopback_port
from tests.engine.tiny_models import hf_greedy
from tests.parallel.conftest import overrides
from tests.platforms import require_simchip

ARCHS = ["llama", "qwen2", "qwen3", "deepseek_v3"]  # qwen2: one KV head, replicated; deepseek_v3: MLA heads split
PROMPT_LENGTHS = [1, 15, 17, 40, 130]
MAX_TOKENS = 8
TEXT_PROMPTS = ["hello", "the quick brown fox jumps"]
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
LAUNCH_TIMEOUT_S = 150


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def tokens(llm, batch) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(batch, GREEDY, use_tqdm=False)]


def worker_processes() -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True)
            if "kunlun_infer.engine.parallel.worker" in " ".join(p.cmdline())]


@pytest.fixture(scope="module")
def single_rank(tiny_model):
    """``single_rank(arch) -> (tokens for prompts(), tokens for TEXT_PROMPTS)`` of a one-rank engine."""
    cache = {}

    def get(arch):
        if arch not in cache:
            with LLM(model=str(tiny_model(arch)), overrides=overrides(1)) as llm:
                cache[arch] = (tokens(llm, prompts()), tokens(llm, TEXT_PROMPTS))
        return cache[arch]

    return get


@pytest.fixture(scope="module")
def references(tiny_model):
    """``references(arch)``: transformers' greedy tokens for ``prompts()``."""
    import transformers as tf

    cache = {}

    def get(arch):
        if arch not in cache:
            hf = tf.AutoModelForCausalLM.from_pretrained(tiny_model(arch), dtype=torch.float32).eval()
            cache[arch] = [hf_greedy(hf, p, MAX_TOKENS) for p in prompts()]
        return cache[arch]

    return get


@pytest.mark.parametrize("arch", ARCHS)
def test_two_ranks_generate_the_tokens_of_one_rank_and_of_transformers(arch, tiny_model, single_rank, references):
    folder = tiny_model(arch)
    threads, cpus = torch.get_num_threads(), os.sched_getaffinity(0)
    shares = core_shares(cpus, 2)  # each rank on its own CPUs (None: fewer CPUs than ranks, nothing bound)
    with LLM(model=str(folder), overrides=overrides(2)) as llm:
        assert llm.config.comm.name == "gloo"  # comm=single cannot join processes: chosen for the user
        (worker,) = worker_processes()
        assert llm.engine.runner.model.model.layers[0].mlp.down_proj.ctx.streams is None  # sync: inline collectives
        # the two ranks share this host's threads and CPUs
        assert torch.get_num_threads() == min([max(1, threads // 2), *(len(s) for s in shares or [])])
        assert (os.sched_getaffinity(0), set(worker.cpu_affinity())) == \
            ((set(shares[0]), set(shares[1])) if shares else (cpus, cpus))
        # one host: the ranks meet in shared memory (where the native kernels are built), not in gloo's sockets
        assert (llm.engine.runtime.comm.host is not None) == (cpu_native.library() is not None)
        two = tokens(llm, prompts())
        stats = llm.engine.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert worker_processes() == []
    assert torch.get_num_threads() == threads and os.sched_getaffinity(0) == cpus  # given back on close
    assert two == references(arch)
    assert two == single_rank(arch)[0]


@pytest.mark.parametrize("arch", ARCHS)
def test_two_simchip_ranks_on_its_attention_backend_generate_the_tokens_of_transformers(arch, tiny_model,
                                                                                          references):
    require_simchip()
    with LLM(model=str(tiny_model(arch)), overrides=overrides(2) + ["platform=simchip"]) as llm:
        # the workers build theirs alike; latent attention falls back to the framework's reference MLA backend
        expected = "reference-mla" if arch.startswith("deepseek") else "simchip-kunlun-layout"
        assert llm.engine.runner.attention.name == expected
        two = tokens(llm, prompts())
        stats = llm.engine.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert two == references(arch)


@pytest.mark.parametrize("arch, expert_size", [("qwen3_moe", 1), ("qwen3_moe", 2), ("mixtral", 2),
                                               ("deepseek_v2", 2), ("deepseek_v3", 2)])
def test_two_ranks_of_a_mixture_of_experts_generate_the_tokens_of_one_rank(arch, expert_size, tiny_model,
                                                                            single_rank, references):
    """Experts split like a dense MLP (expert_size=1) or whole experts per rank, tokens sent to them through the
    comm's all-to-all (expert_size=2): both give one rank's tokens, which are transformers'."""
    with LLM(model=str(tiny_model(arch)), overrides=overrides(2) + [f"parallel.expert_size={expert_size}"]) as llm:
        experts = next(m for m in llm.engine.runner.model.modules() if isinstance(m, FusedExperts))
        assert experts.expert_parallel is (expert_size == 2)
        two = tokens(llm, prompts())
        stats = llm.engine.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert two == single_rank(arch)[0]
    assert two == references(arch)


def test_expert_size_other_than_one_or_the_tensor_size_is_refused(tiny_model):
    with pytest.raises(ConfigError, match=r"parallel.expert_size=3 must be 1 .* or parallel.tensor_size=2"):
        LLM(model=str(tiny_model("mixtral")), overrides=overrides(2) + ["parallel.expert_size=3"])
    assert worker_processes() == []


def test_a_separate_comm_stream_pipelines_all_reduces_without_changing_tokens(tiny_model, single_rank):
    with LLM(model=str(tiny_model("llama")), overrides=overrides(2) + ["streams=simchip"]) as llm:
        down_proj = llm.engine.runner.model.model.layers[0].mlp.down_proj
        assert down_proj.ctx.streams is not None  # the 130-token prefill is cut into overlapped chunks
        assert tokens(llm, prompts()) == single_rank("llama")[0]


# ---------------------------------------------------------------------- torchrun


def generate_command(folder, rank_args: list[str]) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", *rank_args, "-m", "kunlun_infer", "generate",
           f"model.path={folder}", f"max_tokens={MAX_TOKENS}", "--json", *overrides(1)]
    return cmd + [f"prompt={p}" for p in TEXT_PROMPTS]


def run_all(commands: list[list[str]]) -> list[subprocess.CompletedProcess]:
    """Run the commands at once (they rendezvous with each other); kill them all past the timeout."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for c in commands]
    results = []
    try:
        for proc, cmd in zip(procs, commands, strict=True):
            out, err = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
            results.append(subprocess.CompletedProcess(cmd, proc.returncode, out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return results


def json_tokens(result: subprocess.CompletedProcess) -> list[list[int]]:
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line)["token_ids"] for line in result.stdout.splitlines() if line.startswith("{")]


def test_torchrun_on_one_host_generates_the_embedded_tokens(tiny_model, single_rank):
    folder = tiny_model("llama")
    (result,) = run_all([generate_command(folder, ["--standalone", "--nproc-per-node", "2"])])
    assert json_tokens(result) == single_rank("llama")[1]


def test_two_hosts_through_torchrun_rendezvous_generate_the_embedded_tokens(tiny_model, single_rank):
    folder = tiny_model("llama")
    endpoint = f"127.0.0.1:{free_loopback_port()}"
    hosts = [generate_command(folder, ["--nnodes", "2", "--node-rank", str(k), "--nproc-per-node", "1",
                                       "--rdzv-endpoint", endpoint]) for k in (0, 1)]
    host0, host1 = run_all(hosts)
    assert json_tokens(host0) == single_rank("llama")[1]  # rank 0 (host 0) drives the engine and prints
    assert host1.returncode == 0 and json_tokens(host1) == []  # rank 1 serves its shard silently


def test_two_ranks_check_prompt_lookup_drafts_and_write_the_same_tokens(tiny_model):
    import transformers as tf

    folder = tiny_model("llama")
    repetitive = [[7, 8, 9] * 6 + p for p in prompts()]
    hf = tf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    expected = [hf_greedy(hf, p, 16) for p in repetitive]
    with LLM(model=str(folder), overrides=overrides(2) + ["speculative.method=ngram", "speculative.num_tokens=3",
                                                          "speculative.ngram_min=1"]) as llm:
        outs = llm.generate(repetitive, SamplingParams(max_tokens=16, temperature=0), use_tqdm=False)
        stats = llm.engine.stats()
    assert [o.token_ids for o in outs] == expected
    assert stats["spec_verifications"] > 0 and stats["kv_blocks_free"] == stats["kv_blocks_total"]


@pytest.mark.skipif(cpu_native.library() is None, reason="captured steps need the native CPU kernels")
@pytest.mark.parametrize("arch,dtype,sizes", [("llama", "float32", None), ("qwen2", "bfloat16", "[1,2,4]")])
def test_two_ranks_replay_their_captured_decode_steps_in_lockstep_with_the_eager_steps_bits(arch, dtype, sizes,
                                                                                            tiny_model):
    # three requests that finish one after another: the batch shrinks through 3, 2 and 1 (padded to 4 and 2 with
    # ops.step_graph_sizes, every rank capturing those at start); tokens and logprobs as the eager steps give them
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=2) for n in (4, 7, 10)]
    batch = prompts()[:3]
    keys = {"model__dtype": dtype} | ({"ops__step_graph_sizes": sizes} if sizes else {})

    def run(**more):
        with LLM(model=str(tiny_model(arch)), overrides=overrides(2, **keys, **more)) as llm:
            outs = llm.generate(batch, params, use_tqdm=False)
            graphs = llm.engine.runner.graphs
            seen = None if graphs is None else (graphs.batch_sizes, graphs.replays, dict(graphs.refused))
            capturable = llm.engine.runtime.comm.capturable
        return [(o.token_ids, o.logprobs) for o in outs], seen, capturable

    eager, none, _ = run(ops__step_graphs=0)
    replayed, (batch_sizes, replays, refused), capturable = run()
    assert none is None and capturable  # gloo on one host: its all-reduces are recorded with the kernels
    assert replayed == eager
    assert refused == {} and replays >= 6
    assert batch_sizes == ([1, 2, 3] if sizes is None else [1, 2, 4])


def test_a_comm_plugin_written_before_hook_api_1_9_loads_reduces_and_its_tensor_parallel_steps_run_eagerly(
        tiny_model):
    import threading

    from kunlun_infer import compose_config
    from kunlun_infer.engine.step_graph import step_graphs
    from kunlun_infer.hookspecs import HOOK_API_VERSION
    from kunlun_infer.models import load_model
    from kunlun_infer.runtime import PluginManager, Runtime
    from tests.parallel.test_pipeline import PluginBefore14  # a comm of hook API 1.3: no capturable either

    assert HOOK_API_VERSION >= (1, 9)
    manager = PluginManager.load(entry_points=False)
    manager.register(PluginBefore14())
    folder = tiny_model("llama")
    seen: dict[str, list] = {}

    def rank(r: int, comm: str, url: str) -> None:  # ranks in threads: the plugin's own collectives, as ever
        cfg = compose_config(overrides(2) + [f"comm={comm}", f"model.path={folder}"], plugin_manager=manager)
        with Runtime.from_config(cfg, plugin_manager=manager) as rt:
            rt.init_comm(rank=r, world_size=2, init_method=url)
            model = load_model(folder, runtime=rt, dtype=torch.float32, tp_rank=r, tp_size=2)
            graphs = step_graphs(rt, model, max_model_len=512, block_size=16)
            total = rt.comm.all_reduce(torch.tensor([float(r + 1)])).item()
            seen.setdefault(comm, []).append((rt.comm.capturable, graphs is not None, total))

    for comm in ("gloo-1.3", "gloo"):
        url = f"tcp://127.0.0.1:{free_loopback_port()}"
        threads = [threading.Thread(target=rank, args=(r, comm, url)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert seen["gloo-1.3"] == [(False, False, 3.0)] * 2  # reduces as it always did; steps stay eager
    assert seen["gloo"] == [(True, True, 3.0)] * 2  # the built-in gloo of 1.9: captured tensor-parallel steps
