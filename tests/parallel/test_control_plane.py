"""The control plane: a step's flat batch survives the trip to the workers; the process layout sets the config;
the KV cache reaches the other ranks only through an explicit resize."""

from __future__ import annotations

import contextlib
import threading
import types

import pytest
import torch

from kunlun_infer import ConfigError, compose_config
from kunlun_infer.engine.model_runner import build_step_inputs
from kunlun_infer.engine.parallel.control_plane import ControlPlane, Kind, exchange_status, pack_step, unpack_step
from kunlun_infer.engine.parallel.driver import DriverRunner
from kunlun_infer.engine.parallel.placement import Place, resolve_parallel_config, torchrun_place
from kunlun_infer.engine.params import SamplingParams
from kunlun_infer.engine.sequence import Sequence
from kunlun_infer.ops.attention import AttentionSpec
from kunlun_infer.ops.reference_attention import ReferenceAttentionBackend
from kunlun_infer.plugins.cpu_comm import GlooComm
from kunlun_infer.plugins.cpu_device import CpuDevice
from kunlun_infer.plugins.cpu_memory import CachingAllocator


def step_inputs(long_prompt: int = 0):
    """A prefill chunk, a finished prompt and a decode, with blocks out of order (and a long prompt if asked)."""
    shapes = [(40, 16, [7, 2, 9], 8), (5, 0, [4], 5), (21, 20, [0, 5], 1)]
    if long_prompt:
        shapes.append((long_prompt, 0, list(range(10, 10 + -(-long_prompt // 16))), long_prompt))
    seqs = []
    for i, (length, computed, blocks, _) in enumerate(shapes):
        seq = Sequence(i, f"r{i}", list(range(100 + i, 100 + i + length)), SamplingParams())
        seq.num_computed_tokens, seq.block_table = computed, blocks
        seqs.append(seq)
    return build_step_inputs(seqs, [n for *_, n in shapes], block_size=16, device=torch.device("cpu"))


def assert_same_step(got, sent):
    for field in ("input_ids", "positions", "logits_indices"):
        assert torch.equal(getattr(got, field), getattr(sent, field)), field
    for field in ("block_size", "query_lens", "context_lens", "block_tables", "slot_mapping"):
        assert getattr(got.attn, field) == getattr(sent.attn, field), field


def test_a_packed_step_unpacks_to_the_same_flat_batch():
    sent = step_inputs()
    header, payload = pack_step(sent)
    assert header[0] == Kind.STEP and payload.dtype == torch.int64
    assert_same_step(unpack_step(header, payload), sent)


def test_messages_travel_over_gloo_to_a_worker(tmp_path):
    """Rank 0 sends a load spec, a KV size, steps and stop; rank 1 receives them in order; both report status."""
    sent, big, received, statuses = step_inputs(), step_inputs(long_prompt=600), [], {}

    def rank(r):
        comm = GlooComm()
        comm.init(rank=r, world_size=2, init_method=f"file://{tmp_path / 'rdzv'}", timeout_s=30)
        plane = ControlPlane(comm, torch.device("cpu"))
        if r == 0:
            plane.send_load({"model_path": "/m", "dtype": "float32"})
            plane.send_heartbeat()
            plane.send_kv(12)
            plane.send_step(sent)
            plane.send_step(big)  # too large to ride inside the message: a second broadcast
            plane.send_stop()
        else:
            while not received or received[-1].kind is not Kind.STOP:
                received.append(plane.receive())
        statuses[r] = exchange_status(comm, torch.device("cpu"), ok=r == 0, free_bytes=1000 + r,
                                      error=None if r == 0 else "ModelLoadError: no room")
        comm.destroy()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [m.kind for m in received] == [Kind.LOAD, Kind.HEARTBEAT, Kind.KV, Kind.STEP, Kind.STEP, Kind.STOP]
    assert received[0].spec == {"model_path": "/m", "dtype": "float32"} and received[2].num_blocks == 12
    assert_same_step(received[3].inputs, sent)
    assert_same_step(received[4].inputs, big)
    for r in range(2):
        assert [(s.ok, s.free_bytes, s.error) for s in statuses[r]] == [
            (True, 1000, None), (False, 1001, "ModelLoadError: no room")]


def test_torchrun_environment_gives_the_place_and_the_tensor_size():
    env = {"TORCHELASTIC_RUN_ID": "x", "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"}
    assert torchrun_place(env) == Place(rank=3, world_size=4, local_rank=1)
    assert torchrun_place({"RANK": "0", "WORLD_SIZE": "2"}) is None  # not started by torchrun
    cfg = resolve_parallel_config(compose_config([]), Place(0, 4, 0))
    assert (cfg.parallel.tensor_size, cfg.comm.name) == (4, "gloo")
    with pytest.raises(ConfigError, match="parallel.tensor_size=2 does not match the 4 processes"):
        resolve_parallel_config(compose_config(["parallel.tensor_size=2"]), Place(0, 4, 0))


def test_comm_is_chosen_only_when_the_config_cannot_serve_the_ranks():
    single = compose_config([])
    assert resolve_parallel_config(single, None) is single  # one rank: untouched
    chosen = compose_config(["parallel.tensor_size=2", "comm=gloo", "comm.timeout_s=7"])
    assert resolve_parallel_config(chosen, None) is chosen
    auto = compose_config(["parallel.tensor_size=2"])
    resolved = resolve_parallel_config(auto, None)
    assert resolved.comm.name == "gloo" and auto.comm.name == "single"  # the caller's config is not changed
    with pytest.raises(ConfigError, match="parallel.tensor_size=0"):
        resolve_parallel_config(compose_config(["parallel.tensor_size=0"]), None)


def test_the_kv_cache_reaches_the_other_ranks_only_through_an_explicit_resize():
    sent = []
    group = types.SimpleNamespace(plane=types.SimpleNamespace(send_kv=sent.append),
                                  collective=lambda what: contextlib.nullcontext())
    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=8, dtype=torch.float32)
    model = types.SimpleNamespace(attention=ReferenceAttentionBackend(spec), num_layers=2)
    memory = CachingAllocator(device=CpuDevice())
    runner = DriverRunner(model, group=group, device=torch.device("cpu"), block_size=4, sampler=None,
                          memory=memory)
    with pytest.raises(AttributeError):
        runner.kv_caches = []  # no assignment that talks to the other ranks behind the caller's back
    runner.resize_kv_cache(5)
    assert sent == [5] and len(runner.kv_caches) == 2 and memory.stats().allocated > 0
    runner.release_kv_cache()  # at shutdown: this rank's memory only, no message
    assert sent == [5] and runner.kv_caches == [] and memory.stats().allocated == 0
