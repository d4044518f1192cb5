"""On a real GPU: the composed runtime allocates, orders streams, runs every op against the reference,
and joins an NCCL group. Skipped on hosts without a CUDA device."""

import pytest
import torch

from kunlun_infer.ops import OP_SPECS, TOLERANCES
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("op", sorted(OP_SPECS))
def test_ops_match_the_reference_on_the_gpu(runtime, op, dtype):
    spec = OP_SPECS[op]
    kernel = runtime.ops.get(op)
    args, kwargs = spec.sample(dtype, runtime.device.torch_device, torch.Generator().manual_seed(0))
    ref_args, _ = spec.sample(dtype, torch.device("cpu"), torch.Generator().manual_seed(0))
    if op == "linear":
        args = (args[0], runtime.ops.get("pack_linear_weight")(args[1]), *args[2:])
    got, want = kernel(*args, **kwargs), spec.reference(*ref_args, **kwargs)
    if spec.in_place_arg is not None:
        got, want = args[spec.in_place_arg], ref_args[spec.in_place_arg]
    rtol, atol = TOLERANCES[dtype]
    for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        torch.testing.assert_close(g.cpu(), w, rtol=rtol, atol=atol)


def test_nccl_group_of_one(runtime, tmp_path):
    runtime.init_comm(rank=0, world_size=1, init_method=f"file://{tmp_path / 'rdzv'}")
    x = torch.tensor([1.5, 2.5], dtype=torch.bfloat16, device=runtime.device.torch_device)
    assert runtime.comm.all_reduce(x).tolist() == [1.5, 2.5]
    assert runtime.comm.broadcast_object({"ok": True}) == {"ok": True}
    runtime.comm.barrier()


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """A random-weight transformers Llama (fp32) saved as safetensors; prompts are token ids."""
    import transformers

    folder = tmp_path_factory.mktemp("cuda-llama")
    config = transformers.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                      eos_token_id=299, bos_token_id=None, pad_token_id=None,
                                      tie_word_embeddings=False, initializer_range=0.2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.float32).eval()
    model.save_pretrained(folder, safe_serialization=True)
    return folder, model


def test_engine_on_the_gpu_matches_transformers_token_for_token(tiny_llama):
    from kunlun_infer import LLM, SamplingParams

    folder, model = tiny_llama
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 299, (n,), generator=g).tolist() for n in (1, 15, 16, 17, 70, 150)]
    references = []
    with torch.no_grad():
        for p in prompts:
            out = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 max_new_tokens=8, do_sample=False, pad_token_id=299)
            references.append(out[0, len(p):].tolist())
    overrides = [*CUDA_RUN[:-1], "model.max_model_len=256", "cache.block_size=16", "scheduler.max_num_seqs=8"]
    with LLM(model=str(folder), overrides=overrides) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
    assert [o.token_ids for o in outs] == references
