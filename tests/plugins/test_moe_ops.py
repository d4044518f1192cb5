"""The mixture-of-experts ops: the references mean what transformers' routers and experts compute, and the
``cpu`` table's grouped ``fused_moe`` runs only the experts that tokens chose."""

from __future__ import annotations

import pytest
import torch

from kunlun_infer.capabilities import DictOpsProvider
from kunlun_infer.ops import OP_SPECS, reference
from kunlun_infer.ops.moe import grouped_fused_moe
from kunlun_infer.plugins import cpu_kernels
from kunlun_infer.testing import ConformanceError, check_op, check_ops

transformers = pytest.importorskip("transformers")
CPU = torch.device("cpu")


def _router(config_class: str, module: str, router_class: str, seed: int, **fields):
    config = getattr(transformers, config_class)(hidden_size=32, **fields)
    models = __import__(f"transformers.models.{module}.modeling_{module}", fromlist=[router_class])
    router = getattr(models, router_class)(config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in router.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
        for b in router.buffers():
            b.copy_(0.5 * torch.randn(b.shape, generator=g))  # DeepSeek-V3's e_score_correction_bias
    return router, torch.randn(13, 32, generator=g)


def _same_choice(weights, ids, hf_weights, hf_ids):
    """Equal per token, whatever order each side lists a token's experts in."""
    order, hf_order = ids.long().argsort(dim=-1), hf_ids.argsort(dim=-1)
    assert torch.equal(ids.long().gather(1, order), hf_ids.gather(1, hf_order))
    torch.testing.assert_close(weights.gather(1, order), hf_weights.float().gather(1, hf_order), rtol=1e-6,
                               atol=1e-6)


@pytest.mark.parametrize("norm", [True, False])
def test_route_equals_qwen3_moe_router(norm):
    router, hidden = _router("Qwen3MoeConfig", "qwen3_moe", "Qwen3MoeTopKRouter", 1, num_experts=8,
                             num_experts_per_tok=3, norm_topk_prob=norm)
    logits, hf_weights, hf_ids = router(hidden)
    weights, ids = reference.moe_route(logits, 3, renormalize=norm)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32 and ids.shape == (13, 3)
    _same_choice(weights, ids, hf_weights, hf_ids)


def test_route_equals_deepseek_v2_group_limited_greedy():
    router, hidden = _router("DeepseekV2Config", "deepseek_v2", "DeepseekV2TopkRouter", 2, n_routed_experts=16,
                             num_experts_per_tok=3, topk_method="group_limited_greedy", n_group=4, topk_group=2,
                             routed_scaling_factor=16.0)
    logits, hf_weights, hf_ids = router(hidden)
    weights, ids = reference.moe_route(logits, 3, num_expert_group=4, topk_group=2, group_score="max",
                                       routed_scaling_factor=16.0)
    _same_choice(weights, ids, hf_weights, hf_ids)


def test_route_equals_deepseek_v3_noaux_tc():
    router, hidden = _router("DeepseekV3Config", "deepseek_v3", "DeepseekV3TopkRouter", 3, n_routed_experts=16,
                             num_experts_per_tok=4, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                             norm_topk_prob=True)
    logits, hf_weights, hf_ids = router(hidden)
    weights, ids = reference.moe_route(logits, 4, scoring="sigmoid", renormalize=True, num_expert_group=4,
                                       topk_group=2, group_score="top2_sum",
                                       correction_bias=router.e_score_correction_bias,
                                       routed_scaling_factor=2.5)
    _same_choice(weights, ids, hf_weights, hf_ids)
    # the bias moves the choice, never the weights: without it other experts win
    _, unbiased = reference.moe_route(logits, 4, scoring="sigmoid", renormalize=True, num_expert_group=4,
                                      topk_group=2, group_score="top2_sum", routed_scaling_factor=2.5)
    assert not torch.equal(unbiased, ids)


def test_route_refuses_an_unknown_scoring_function():
    with pytest.raises(ValueError, match="scoring='tanh'; use one of softmax, sigmoid"):
        reference.moe_route(torch.zeros(2, 4), 2, scoring="tanh")


def test_fused_moe_equals_transformers_experts():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    config = transformers.Qwen3MoeConfig(hidden_size=32, moe_intermediate_size=24, num_experts=6,
                                         num_experts_per_tok=2)
    experts = Qwen3MoeExperts(config)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(experts.gate_up_proj.shape, generator=g) / 6)
        experts.down_proj.copy_(torch.randn(experts.down_proj.shape, generator=g) / 5)
    x = torch.randn(10, 32, generator=g)
    weights, ids = reference.moe_route(torch.randn(10, 6, generator=g), 2, renormalize=True)
    want = experts(x, ids.long(), weights)
    packed = reference.pack_moe_weights(experts.gate_up_proj.data, experts.down_proj.data)
    torch.testing.assert_close(reference.fused_moe(x, packed, weights, ids), want, rtol=1e-5, atol=1e-6)
    cpu = DictOpsProvider(cpu_kernels.kernels())
    packed = cpu.get("pack_moe_weights")(experts.gate_up_proj.data, experts.down_proj.data)
    torch.testing.assert_close(cpu.get("fused_moe")(x, packed, weights, ids), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cpu_fused_moe_never_touches_an_expert_no_token_chose(dtype):
    (x, (w13, w2), weights, ids), _ = OP_SPECS["fused_moe"].sample(dtype, CPU, torch.Generator().manual_seed(5))
    unused = sorted(set(range(w13.shape[0])) - set(ids.flatten().tolist()))
    ids = torch.where(ids == 5, 4, ids)  # expert 5 never chosen
    w13[5], w2[5] = float("nan"), float("nan")
    cpu = DictOpsProvider(cpu_kernels.kernels())
    got = cpu.get("fused_moe")(x, cpu.get("pack_moe_weights")(w13, w2), weights, ids)
    assert torch.isfinite(got).all(), unused
    want = reference.fused_moe(x, (w13, w2), weights, ids)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


def test_grouped_helper_runs_each_active_expert_once_on_its_tokens():
    x = torch.arange(5.0).repeat_interleave(4).view(5, 4)  # row t holds t everywhere
    ids = torch.tensor([[2, 0], [2, -1], [0, 2], [3, 2], [-1, -1]], dtype=torch.int32)
    calls = []

    def expert_mlp(expert, rows):
        calls.append((expert, rows[:, 0].tolist()))
        return rows * (expert + 1)

    out = grouped_fused_moe(x, torch.full((5, 2), 0.5), ids, 4, 4, expert_mlp)
    assert calls == [(0, [0.0, 2.0]), (2, [0.0, 1.0, 2.0, 3.0]), (3, [3.0])]
    assert out[:, 0].tolist() == [0.5 * 0 * 4, 0.5 * 1 * 3, 0.5 * 2 * 4, 0.5 * 3 * 7, 0.0]
    with pytest.raises(ValueError, match="expert id 4 is outside the 4 experts"):
        grouped_fused_moe(x, torch.ones(5, 2), torch.full((5, 2), 4), 4, 4, expert_mlp)


def test_conformance_catches_a_router_that_ignores_the_correction_bias():
    def route_without_bias(logits, top_k, **kwargs):
        kwargs.pop("correction_bias", None)
        return reference.moe_route(logits, top_k, **kwargs)

    provider = DictOpsProvider({"moe_route": route_without_bias})
    check_op(provider, "moe_route", torch.float32, CPU, seed=0)  # the softmax case has no bias: passes
    with pytest.raises(ConformanceError, match=r"op 'moe_route' \(torch.float32.*result\[0\].*beyond tolerance"):
        check_ops(provider, type("Host", (), {"supported_dtypes": lambda self: {torch.float32},
                                                "torch_device": CPU})())


def test_conformance_catches_experts_combined_without_their_weights():
    def fused_moe_unweighted(x, packed, topk_weights, topk_ids):
        return reference.fused_moe(x, packed, torch.ones_like(topk_weights), topk_ids)

    provider = DictOpsProvider({"pack_moe_weights": reference.pack_moe_weights, "fused_moe": fused_moe_unweighted})
    with pytest.raises(ConformanceError, match=r"op 'fused_moe' .* via fused_moe\(x, pack\(w\), \.\.\.\)"):
        check_op(provider, "fused_moe", torch.bfloat16, CPU)
