"""Tensor-parallel shards: each rank loads its slice, slices add up to the whole, two ranks equal one.

Two ranks run in two threads of this process; :class:`ThreadComm` sums or
concatenates what both hand it, in rank order, the way a real comm plugin
would across processes.
"""

from __future__ import annotations

import threading

import pytest
import torch
from omegaconf import OmegaConf

from kunlun_infer.layers import ColumnParallelLinear, LayerContext, RowParallelLinear
from kunlun_infer.models import load_model
from kunlun_infer.plugins.cpu_comm import GlooComm, parse_dtype
from kunlun_infer.testing.comm import free_port
from tests.models.paged import PagedKV, ReferenceRuntime, hf_logits, max_relative_error


class ThreadComm:
    """Collectives between threads of one process (one instance per rank)."""

    def __init__(self, rank: int, world_size: int, shared: dict):
        self.rank, self.world_size = rank, world_size
        self.barrier = shared.setdefault("barrier", threading.Barrier(world_size, timeout=60))
        self.slots = shared.setdefault("slots", [None] * world_size)
        self.calls = 0

    def _exchange(self, tensor):
        self.calls += 1
        self.slots[self.rank] = tensor
        self.barrier.wait()
        parts = list(self.slots)
        self.barrier.wait()
        return parts

    def all_reduce(self, tensor, accumulate_dtype=None):
        dtype = accumulate_dtype or tensor.dtype
        return sum(p.to(dtype) for p in self._exchange(tensor)).to(tensor.dtype)

    def all_gather(self, tensor, dim=-1):
        return torch.cat(self._exchange(tensor), dim=dim)

    def all_to_all(self, tensor, send_splits, recv_splits):
        parts = self._exchange((tensor, list(send_splits)))
        received = []
        for sent, splits in parts:
            start = sum(splits[:self.rank])
            received.append(sent[start:start + splits[self.rank]])
        assert [r.shape[0] for r in received] == list(recv_splits)
        return torch.cat(received)


def comms(world_size=2):
    shared: dict = {}
    return [ThreadComm(r, world_size, shared) for r in range(world_size)]


def run_ranks(fn, world_size=2):
    """Run ``fn(rank, comm)`` on every rank in its own thread; returns the results in rank order."""
    results, errors = [None] * world_size, []

    def target(rank, comm):
        try:
            results[rank] = fn(rank, comm)
        except BaseException as e:  # surfaced below
            errors.append(e)
            comm.barrier.abort()

    threads = [threading.Thread(target=target, args=(r, c)) for r, c in enumerate(comms(world_size))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def load_rank(folder, rank, comm, tp_size=2):
    return load_model(folder, runtime=ReferenceRuntime(comm=comm), dtype=torch.float32, tp_rank=rank,
                      tp_size=tp_size)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2 preset: one KV head, replicated on both ranks
def test_rank_shards_concatenate_to_the_checkpoint(arch, hf_folder):
    folder, hf = hf_folder(arch)
    ranks = [load_rank(folder, r, comms()[r]) for r in range(2)]
    full = {n: p.detach() for n, p in hf.named_parameters()}
    for i in range(2):
        prefix = f"model.layers.{i}."
        attn = [r.model.layers[i].self_attn for r in ranks]
        mlp = [r.model.layers[i].mlp for r in ranks]
        qkv = [a.qkv_proj for a in attn]
        qs, kvs = qkv[0].q_size, qkv[0].kv_size
        assert torch.equal(torch.cat([p.packed_weight[:qs] for p in qkv]), full[prefix + "self_attn.q_proj.weight"])
        k_parts = [p.packed_weight[qs:qs + kvs] for p in qkv]
        v_parts = [p.packed_weight[qs + kvs:] for p in qkv]
        if hf.config.num_key_value_heads >= 2:
            assert torch.equal(torch.cat(k_parts), full[prefix + "self_attn.k_proj.weight"])
            assert torch.equal(torch.cat(v_parts), full[prefix + "self_attn.v_proj.weight"])
        else:  # replicated: every rank holds the single head
            assert all(torch.equal(k, full[prefix + "self_attn.k_proj.weight"]) for k in k_parts)
            assert all(torch.equal(v, full[prefix + "self_attn.v_proj.weight"]) for v in v_parts)
            assert all(torch.equal(p.bias[qs:qs + kvs], full[prefix + "self_attn.k_proj.bias"]) for p in qkv)
        assert torch.equal(torch.cat([a.o_proj.packed_weight for a in attn], dim=1),
                           full[prefix + "self_attn.o_proj.weight"])
        inter = hf.config.intermediate_size // 2
        gate_up = [m.gate_up_proj.packed_weight for m in mlp]
        assert torch.equal(torch.cat([g[:inter] for g in gate_up]), full[prefix + "mlp.gate_proj.weight"])
        assert torch.equal(torch.cat([g[inter:] for g in gate_up]), full[prefix + "mlp.up_proj.weight"])
        assert torch.equal(torch.cat([m.down_proj.packed_weight for m in mlp], dim=1),
                           full[prefix + "mlp.down_proj.weight"])
    assert torch.equal(torch.cat([r.model.embed_tokens.weight for r in ranks]), full["model.embed_tokens.weight"])
    assert [r.num_kv_heads for r in ranks] == [max(1, hf.config.num_key_value_heads // 2)] * 2


def test_column_then_row_parallel_sums_to_the_unsharded_product():
    g = torch.Generator().manual_seed(0)
    w1, w2, b2 = torch.randn(24, 10, generator=g), torch.randn(6, 24, generator=g), torch.randn(6, generator=g)
    x = torch.randn(5, 10, generator=g)
    ops = ReferenceRuntime().resolve_ops(["linear", "pack_linear_weight"])

    def rank(r, comm):
        ctx = LayerContext(ops=ops, device=torch.device("cpu"), dtype=torch.float32, tp_rank=r, tp_size=2, comm=comm)
        column, row = ColumnParallelLinear(10, 24, False, ctx), RowParallelLinear(24, 6, True, ctx)
        column.load_weight("weight", None, w1)
        row.load_weight("weight", None, w2)
        row.load_weight("bias", None, b2)
        column.pack_weights()
        row.pack_weights()
        return row(column(x)), comm.calls

    (out0, calls0), (out1, _) = run_ranks(rank)
    torch.testing.assert_close(out0, x @ w1.T @ w2.T + b2, rtol=1e-5, atol=1e-5)
    assert torch.equal(out0, out1) and calls0 == 1


@pytest.mark.parametrize("arch, overrides", [("llama", {}), ("qwen2", {}), ("qwen3", {}),
                                             ("llama", {"vocab_size": 317}),  # uneven vocabulary split
                                             ("deepseek_v2", {}), ("deepseek_v3", {})])  # MLA: heads split
def test_two_ranks_compute_transformers_logits(arch, overrides, hf_folder):
    folder, hf = hf_folder(arch, **overrides)
    g = torch.Generator().manual_seed(4)
    prompts = {i: torch.randint(3, 300, (n,), generator=g).tolist() for i, n in enumerate([1, 6, 13])}

    def rank(r, comm):
        kv = PagedKV(load_rank(folder, r, comm), block_size=4)
        first = kv.step(prompts)
        return first, kv.step({i: [7] for i in prompts})

    (prefill0, decode0), (prefill1, decode1) = run_ranks(rank)
    for i, tokens in prompts.items():
        assert torch.equal(prefill0[i], prefill1[i]) and torch.equal(decode0[i], decode1[i])
        assert max_relative_error(prefill0[i], hf_logits(hf, tokens)) < 1e-4
        assert max_relative_error(decode0[i], hf_logits(hf, tokens + [7])[-1:]) < 1e-4


def test_one_rank_calls_no_collective(hf_folder):
    class Refusing:
        def __getattr__(self, name):
            raise AssertionError(f"collective {name} called with tp_size=1")

    folder, _ = hf_folder("llama")
    model = load_model(folder, runtime=ReferenceRuntime(comm=Refusing()), dtype=torch.float32)
    PagedKV(model).step({0: [3, 4, 5]})


class RecordingGloo(GlooComm):
    """The built-in gloo comm, noting the dtype each all-reduce was actually carried out in."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.reduced_in: list[torch.dtype] = []

    def all_reduce(self, tensor, accumulate_dtype=None):
        self.reduced_in.append(self.accumulate_dtype_for(tensor, accumulate_dtype) or tensor.dtype)
        return super().all_reduce(tensor, accumulate_dtype)


@pytest.mark.parametrize("setting, reduced_in", [("float32", torch.float32), ("none", torch.bfloat16)])
def test_comm_accumulate_dtype_decides_what_a_bf16_model_reduces_in(setting, reduced_in, hf_folder):
    folder, _ = hf_folder("llama", dtype=torch.bfloat16)
    cfg = OmegaConf.create({"comm": {"name": "gloo", "accumulate_dtype": setting}})
    url = f"tcp://127.0.0.1:{free_port()}"
    results, errors = [None, None], []

    def rank(r):
        try:
            comm = RecordingGloo(accumulate_dtype=parse_dtype(setting))  # what the gloo factory builds from cfg
            comm.init(rank=r, world_size=2, init_method=url, timeout_s=60)
            runtime = ReferenceRuntime(comm=comm)
            runtime.config = cfg
            model = load_model(folder, runtime=runtime, dtype=torch.bfloat16, tp_rank=r, tp_size=2)
            PagedKV(model).step({0: [3, 4, 5]})
            comm.destroy()
            results[r] = comm.reduced_in
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert results[0] and set(results[0]) == {reduced_in} and results[0] == results[1]
