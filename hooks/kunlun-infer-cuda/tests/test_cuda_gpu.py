"""On a real GPU: the composed runtime allocates, orders streams and joins an NCCL group; the engine gives
transformers' tokens with every lever of the plugin on (Triton attention and norms, CUDA graphs) and off, and
captures again after its KV cache is reallocated. Every op against its reference: test_cuda_conformance.py.
Skipped on hosts without a CUDA device."""

import pytest
import torch

from kunlun_infer.runtime import PluginManager, Runtime, compose_config

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

CUDA_RUN = ["device=cuda", "memory=cuda", "ops=cuda", "streams=cuda", "comm=nccl"]


@pytest.fixture(scope="module")
def runtime():
    manager = PluginManager.load()
    with Runtime.from_config(compose_config(CUDA_RUN, plugin_manager=manager), plugin_manager=manager) as rt:
        yield rt


def test_memory_stats_follow_allocations(runtime):
    before = runtime.memory.stats().allocated
    t = runtime.memory.allocate((1024, 1024), torch.float32)
    assert t.is_cuda and t.data_ptr() % runtime.memory.alignment == 0
    assert runtime.memory.stats().allocated >= before + 4 * 2**20
    runtime.memory.free(t)
    assert runtime.memory.stats().allocated == before


def test_streams_order_work_with_events(runtime):
    compute, comm = runtime.streams.compute_stream(), runtime.streams.comm_stream()
    x = torch.zeros(1 << 20, device=runtime.device.torch_device)
    compute.submit(lambda: [x.add_(1.0) for _ in range(50)])
    done = compute.record_event()
    comm.wait_event(done)
    out = []
    comm.submit(lambda: out.append(x.sum()))
    runtime.streams.synchronize()
    assert out[0].item() == 50.0 * (1 << 20)


def test_nccl_group_of_one(runtime, tmp_path):
    runtime.init_comm(rank=0, world_size=1, init_method=f"file://{tmp_path / 'rdzv'}")
    x = torch.tensor([1.5, 2.5], dtype=torch.bfloat16, device=runtime.device.torch_device)
    assert runtime.comm.all_reduce(x).tolist() == [1.5, 2.5]
    assert runtime.comm.broadcast_object({"ok": True}) == {"ok": True}
    runtime.comm.barrier()


#: the plugin's levers: everything on (the default), and the torch kernels run eagerly
LEVERS = {"default": [], "torch-eager": ["ops.attention=sdpa", "ops.fused_kernels=off", "ops.step_graphs=0"]}


@pytest.mark.parametrize("levers", sorted(LEVERS))
def test_engine_on_the_gpu_matches_transformers_token_for_token(tiny_llama, tiny_llama_greedy, levers):
    from kunlun_infer import LLM, SamplingParams
    from kunlun_infer.runtime.guard import unwrap

    folder, _ = tiny_llama
    prompts, references = tiny_llama_greedy
    overrides = [*CUDA_RUN[:-1], "model.max_model_len=256", "cache.block_size=16", "scheduler.max_num_seqs=8",
                 *LEVERS[levers]]
    with LLM(model=str(folder), overrides=overrides) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
        described = unwrap(llm.engine.runtime.ops).describe()
        graphs = llm.engine.runner.graphs
        replays = 0 if graphs is None else graphs.replays
    assert [o.token_ids for o in outs] == references
    if levers == "default":  # Triton attention and norms, decode steps replayed from CUDA graphs
        assert described == {"attention": "triton-paged", "norms_rotary_swiglu": "triton-fused"}
        assert replays > 0
    else:
        assert described == {"attention": "sdpa-gather", "norms_rotary_swiglu": "torch"} and replays == 0


def test_decode_steps_are_captured_again_after_the_kv_cache_is_reallocated(tiny_llama):
    from kunlun_infer import LLM, SamplingParams

    folder, _ = tiny_llama
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 299, (n,), generator=g).tolist() for n in (3, 40, 90)]
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    overrides = [*CUDA_RUN[:-1], "model.max_model_len=256", "scheduler.max_num_seqs=8", "cache.num_blocks=64",
                 "cache.prefix_caching=false"]
    with LLM(model=str(folder), overrides=overrides) as llm:
        first = [o.token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        graphs = llm.engine.runner.graphs
        captures, replays = graphs.captures, graphs.replays
        assert captures > 0 and replays > 0
        llm.engine.runner.resize_kv_cache(64)  # drops every capture: their buffers pointed into the old cache
        assert graphs.batch_sizes == []
        again = [o.token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        assert again == first
        assert graphs.captures > captures and graphs.replays > replays and not graphs.refused
