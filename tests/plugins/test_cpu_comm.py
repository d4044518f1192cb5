"""The built-in comm plugins: ``single`` identities, ``gloo`` accumulation in float32 by default."""

from __future__ import annotations

import threading

import pytest
import torch
from omegaconf import OmegaConf

from kunlun_infer.plugins.cpu_comm import GlooComm, SingleComm, make_gloo, parse_dtype
from kunlun_infer.testing.comm import free_port


def test_single_is_a_world_of_one():
    comm = SingleComm()
    comm.init(rank=0, world_size=1)
    t = torch.ones(3)
    assert comm.all_reduce(t) is t and comm.all_gather(t) is t and comm.broadcast_object({"a": 1}) == {"a": 1}
    with pytest.raises(ValueError, match="choose comm=gloo"):
        SingleComm().init(rank=1, world_size=2)


def test_accumulate_dtype_parsing():
    assert parse_dtype("float32") is torch.float32 and parse_dtype("none") is None
    with pytest.raises(ValueError, match="comm.accumulate_dtype='float33'"):
        parse_dtype("float33")


def _all_reduce_on_threads(make_comm, inputs):
    """Each input on its own rank (a thread) of one gloo group; returns every rank's result."""
    url, world = f"tcp://127.0.0.1:{free_port()}", len(inputs)
    results, errors = [None] * world, []

    def rank(r):
        try:
            comm = make_comm()
            comm.init(rank=r, world_size=world, init_method=url, timeout_s=60)
            results[r] = comm.all_reduce(inputs[r].clone())
            comm.barrier()
            comm.destroy()
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    return results


def test_gloo_bf16_all_reduce_accumulates_in_float32_by_default():
    g = torch.Generator().manual_seed(0)
    inputs = [(torch.randn(2048, generator=g) * 10 ** r).to(torch.bfloat16) for r in range(3)]
    exact = sum(t.double() for t in inputs).to(torch.bfloat16)

    widened = _all_reduce_on_threads(lambda: make_gloo(config=OmegaConf.create({}), device=None), inputs)
    assert all(torch.equal(r, exact) and r.dtype == torch.bfloat16 for r in widened)

    narrow = _all_reduce_on_threads(
        lambda: make_gloo(config=OmegaConf.create({"accumulate_dtype": "none"}), device=None), inputs)
    assert not torch.equal(narrow[0], exact)  # summing in bf16 loses bits: why float32 is the default


def test_gloo_used_before_init_says_so():
    with pytest.raises(RuntimeError, match="before init"):
        GlooComm().all_reduce(torch.ones(1))


class OutOfOrderGloo(GlooComm):
    """Delivers a rank's messages the wrong way round: what a broken point-to-point plugin would do."""

    def recv(self, tensor, src):
        if not hasattr(self, "held"):
            self.held = super().recv(tensor.clone(), src)
            second = super().recv(tensor, src)
            return second
        tensor.copy_(self.held)
        return tensor


@pytest.mark.parametrize("comm_class", [GlooComm, OutOfOrderGloo])
def test_point_to_point_conformance_passes_gloo_and_catches_messages_out_of_order(comm_class):
    from kunlun_infer.testing.comm import run_point_to_point
    from kunlun_infer.testing.compare import ConformanceError

    url, errors = f"tcp://127.0.0.1:{free_port()}", [None, None]

    def rank(r):
        comm = comm_class()
        try:
            comm.init(rank=r, world_size=2, init_method=url, timeout_s=20)
            run_point_to_point(comm, torch.device("cpu"), r, 2)
        except Exception as exc:  # noqa: BLE001 - checked below
            errors[r] = exc
        finally:
            comm.destroy()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if comm_class is GlooComm:
        assert errors == [None, None]
    else:
        assert all(isinstance(e, ConformanceError) and "message 0" in str(e) for e in errors), errors


def test_gloo_keeps_a_collectives_tensors_until_the_group_is_gone_and_no_longer_than_a_few_collectives():
    # torch < 2.8 destroys a gloo group holding the GIL while its worker thread may still be letting go of the last
    # collective; a tensor freed by then needs the GIL in that thread, and destroy() would hang for ever
    import weakref

    from kunlun_infer.plugins.process_group import SETTLING_COLLECTIVES

    comm = make_gloo(config=OmegaConf.create({}), device=None)
    comm.init(rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{free_port()}", timeout_s=30)
    given = torch.ones(4)
    gathered = comm.all_to_all(torch.arange(3.0), [3], [3])
    kept, parts = weakref.ref(given), weakref.ref(gathered)
    assert torch.equal(comm.all_reduce(given), torch.ones(4))
    del given, gathered
    assert kept() is not None and parts() is not None  # still the comm's, though the caller let go

    comm.destroy()
    assert kept() is None and parts() is None  # released once the group is gone

    comm.init(rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{free_port()}", timeout_s=30)
    first = torch.ones(2)
    comm.all_reduce(first)
    first_ref = weakref.ref(first)
    del first
    for _ in range(SETTLING_COLLECTIVES):
        comm.barrier()
    assert first_ref() is None  # a bounded window, not a leak
    comm.destroy()
