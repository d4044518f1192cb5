"""Qwen3-MoE and Mixtral: config parsing, transformers' logits in fp32 and bf16, and two ranks — experts split
like a dense MLP (tensor parallelism) or whole experts per rank (expert parallelism) — equal to one."""

from __future__ import annotations

import json

import pytest
import torch

from kunlun_infer.capabilities import Comm
from kunlun_infer.errors import ModelLoadError
from kunlun_infer.layers.moe import FusedExperts
from kunlun_infer.layers.quantization import Quantization
from kunlun_infer.models import SUPPORTED_ARCHITECTURES, load_model, load_model_config
from kunlun_infer.models.loader import checkpoint_index
from tests.models.hf_factory import load_hf_model
from tests.models.paged import PagedKV, hf_logits, max_relative_error
from tests.models.test_tensor_parallel import ReferenceRuntime, run_ranks

MOE_ARCHS = ["qwen3_moe", "mixtral"]


def prompts(seed=4):
    g = torch.Generator().manual_seed(seed)
    return {i: torch.randint(3, 300, (n,), generator=g).tolist() for i, n in enumerate([1, 6, 13, 40])}


def test_config_says_which_layers_have_experts_and_how_tokens_are_routed(hf_folder):
    qwen = load_model_config(hf_folder("qwen3_moe")[0])
    assert qwen.architecture == "Qwen3MoeForCausalLM" and qwen.qk_norm
    assert qwen.moe.sparse_layers == (True, False, True)  # mlp_only_layers=[1]
    assert (qwen.moe.num_experts, qwen.moe.top_k, qwen.moe.intermediate_size, qwen.moe.renormalize) == (8, 2, 48, True)
    mixtral = load_model_config(hf_folder("mixtral")[0])
    assert mixtral.moe.sparse_layers == (True, True) and mixtral.moe.renormalize
    assert mixtral.moe.intermediate_size == 96 and mixtral.moe.num_experts == 4
    assert load_model_config(hf_folder("llama")[0]).moe is None


def test_decoder_sparse_step_puts_experts_in_every_other_layer(hf_folder, tmp_path):
    folder, _ = hf_folder("qwen3_moe")
    raw = json.loads((folder / "config.json").read_text())
    raw.update(decoder_sparse_step=2, mlp_only_layers=[], num_hidden_layers=4)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert load_model_config(tmp_path).moe.sparse_layers == (False, True, False, True)


def test_unknown_architectures_are_refused_listing_the_supported_ones(hf_folder, tmp_path):
    raw = json.loads((hf_folder("mixtral")[0] / "config.json").read_text())
    raw.update(architectures=["JambaForCausalLM"], model_type="jamba")
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match="JambaForCausalLM is not supported; supported: .*Qwen3MoeForCausalLM, "
                                             "MixtralForCausalLM"):
        load_model_config(tmp_path)
    assert {"Qwen3MoeForCausalLM", "MixtralForCausalLM"} <= set(SUPPORTED_ARCHITECTURES)


#: a router whose k-th and (k+1)-th expert probabilities (float32) are closer than this may be resolved either way
#: in bf16, which keeps 8 significant bits: a flip measured at 1.8e-3 on these random routers
ROUTING_TIE = 3e-3


def near_ties(hf_model, tokens: list[int]) -> set[int]:
    """Positions of ``tokens`` where some layer's float32 router nearly ties at the top-k boundary."""
    k, ties, hooks = hf_model.config.num_experts_per_tok, set(), []

    def record(module, inputs, output):
        logits = (output[0] if isinstance(output, tuple) else output).float().reshape(len(tokens), -1)
        top = logits.softmax(-1).topk(k + 1, dim=-1).values
        ties.update(torch.nonzero(top[:, k - 1] - top[:, k] < ROUTING_TIE).flatten().tolist())

    for name, module in hf_model.named_modules():
        if name.endswith(".gate"):
            hooks.append(module.register_forward_hook(record))
    try:
        hf_logits(hf_model, tokens)
    finally:
        for hook in hooks:
            hook.remove()
    return ties


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_bf16_checkpoint_logits_within_tolerance_of_transformers(arch, hf_folder, runtime):
    # measured against transformers on the same bf16 weights computed in float32. In bf16 a token whose k-th and
    # (k+1)-th experts nearly tie may be routed either way by any two implementations (transformers' own bf16 run
    # strays ~0.1 from float32 on such a token), so those few tokens are left out; every other one must agree
    folder, _ = hf_folder(arch, dtype=torch.bfloat16)
    hf32 = load_hf_model(folder, torch.float32)
    model = load_model(folder, runtime=runtime, dtype=torch.bfloat16)
    out = PagedKV(model, block_size=4).step(prompts())
    checked = 0
    for i, tokens in prompts().items():
        keep = [j for j in range(len(tokens)) if j not in near_ties(hf32, tokens)]
        checked += len(keep)
        if keep:
            assert max_relative_error(out[i][keep], hf_logits(hf32, tokens)[keep]) < 3e-2, f"prompt {i}"
    assert checked >= 0.8 * sum(len(t) for t in prompts().values()), "too few tokens are clear of routing ties"


def test_int8_quantization_is_refused_for_expert_weights(hf_folder, runtime):
    folder, _ = hf_folder("mixtral")
    with pytest.raises(ModelLoadError, match="model.quantization=int8 does not cover the expert weights of "
                                             "MixtralForCausalLM yet; load it with model.quantization=none"):
        load_model(folder, runtime=runtime, dtype=torch.float32, quantization=Quantization())


def load_rank(folder, rank, comm, expert_size):
    return load_model(folder, runtime=ReferenceRuntime(comm=comm), dtype=torch.float32, tp_rank=rank, tp_size=2,
                      expert_size=expert_size)


def experts_of(model):
    return [m for m in model.modules() if isinstance(m, FusedExperts)]


@pytest.mark.parametrize("expert_size", [1, 2], ids=["tensor-parallel-experts", "expert-parallel"])
@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_two_ranks_compute_transformers_logits(arch, expert_size, hf_folder):
    folder, hf = hf_folder(arch)
    calls = {}

    def rank(r, comm):
        model = load_rank(folder, r, comm, expert_size)
        kv = PagedKV(model, block_size=4)
        first = kv.step(prompts())
        second = kv.step({i: [7] for i in prompts()})
        calls[r] = comm.calls
        return model, first, second

    (model0, prefill0, decode0), (model1, prefill1, decode1) = run_ranks(rank)
    for i, tokens in prompts().items():
        assert torch.equal(prefill0[i], prefill1[i]) and torch.equal(decode0[i], decode1[i])
        assert max_relative_error(prefill0[i], hf_logits(hf, tokens)) < 1e-4
        assert max_relative_error(decode0[i], hf_logits(hf, tokens + [7])[-1:]) < 1e-4
    config = hf.config
    total = config.num_local_experts if arch == "mixtral" else config.num_experts
    inter = config.intermediate_size if arch == "mixtral" else config.moe_intermediate_size
    for r, model in enumerate((model0, model1)):
        for experts in experts_of(model):
            w13, w2 = experts.packed_weight  # the reference ops keep the stacked pair
            if expert_size == 1:  # every expert, half its intermediate features
                assert tuple(w13.shape) == (total, inter, config.hidden_size)
            else:  # half the experts, whole
                assert tuple(w13.shape) == (total // 2, 2 * inter, config.hidden_size)
                assert experts.first_expert == r * total // 2
            assert w2.shape[0] == w13.shape[0]


def test_expert_parallel_rank_holds_only_its_experts_tensors(hf_folder):
    folder, _ = hf_folder("mixtral")

    def rank(r, comm):
        m = load_rank(folder, r, comm, 2)
        return sorted(n for n in m.checkpoint_tensors() if ".experts." in n), m.held_elsewhere

    (mine0, elsewhere0), (mine1, elsewhere1) = run_ranks(rank)
    assert set(mine0) == set(elsewhere1) and set(mine1) == set(elsewhere0)
    assert mine0 and all(".experts.0." in n or ".experts.1." in n for n in mine0)
    stored = {n for n in checkpoint_index(folder) if ".experts." in n}
    assert set(mine0) | set(mine1) == stored and not set(mine0) & set(mine1)


class CommBefore14(Comm):
    """A comm plugin written for hook API 1.0: collectives between threads, no ``all_to_all`` of its own."""

    def __init__(self, thread_comm):
        self.inner, self.rank, self.world_size = thread_comm, thread_comm.rank, thread_comm.world_size

    def init(self, *, rank, world_size, init_method=None, timeout_s=60.0):
        pass

    def all_reduce(self, tensor, accumulate_dtype=None):
        return self.inner.all_reduce(tensor, accumulate_dtype)

    def all_gather(self, tensor, dim=-1):
        return self.inner.all_gather(tensor, dim)

    def broadcast(self, tensor, src=0):
        raise AssertionError("not used by a forward pass")

    broadcast_object = broadcast

    def barrier(self):
        pass

    def destroy(self):
        pass


def test_expert_parallelism_runs_on_a_comm_plugin_written_before_all_to_all(hf_folder):
    folder, hf = hf_folder("qwen3_moe")
    assert "all_to_all" not in CommBefore14.__dict__  # served by Comm's default, built on all_gather

    def rank(r, comm):
        model = load_rank(folder, r, CommBefore14(comm), expert_size=2)
        return PagedKV(model, block_size=4).step(prompts())

    out0, out1 = run_ranks(rank)
    for i, tokens in prompts().items():
        assert torch.equal(out0[i], out1[i])
        assert max_relative_error(out0[i], hf_logits(hf, tokens)) < 1e-4


def test_expert_parallel_step_of_one_token_leaves_one_rank_without_tokens(hf_folder):
    folder, hf = hf_folder("mixtral")

    def rank(r, comm):
        return PagedKV(load_rank(folder, r, comm, expert_size=2), block_size=4).step({0: [11]})

    out0, out1 = run_ranks(rank)
    assert torch.equal(out0[0], out1[0])
    assert max_relative_error(out0[0], hf_logits(hf, [11])) < 1e-4
