"""A test plugin ``flaky`` whose memory, ops and comm work like the built-ins until told to fail.

Installed through the entry-point group like any plugin (see
``test_faults.py``), it offers ``memory=flaky``, ``ops=flaky`` and
``comm=flaky``:

- ``memory.fail_at=N``: the N-th ``allocate`` raises. Every allocator made is
  kept in :data:`ALLOCATORS`, so a test can check that nothing stayed allocated.
- ``ops=flaky``: the plain-torch kernels, counting calls (providers kept in
  :data:`PROVIDERS`); ``runtime.ops.arm(op, after=N)`` makes the N-th call of
  ``op`` from then on raise (once).
- ``comm.fail_at=N``: on rank 0, the N-th ``all_reduce`` raises instead of
  reducing (gloo collectives otherwise).
- ``ops.fail_op=OP ops.fail_at=N ops.fail_rank=R``: the N-th call of ``OP``
  raises on the process whose device index is ``R`` (its local rank), for a
  failure on one rank of a tensor-parallel group, which ``arm`` cannot reach.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from kunlun_infer.capabilities import DictOpsProvider, MemoryAllocator
from kunlun_infer.config import CommConfig, MemoryConfig, OpsConfig
from kunlun_infer.hookspecs import ConfigOption, PluginInfo, hookimpl
from kunlun_infer.plugins.cpu_comm import GlooComm
from kunlun_infer.plugins.cpu_memory import SimpleAllocator
from kunlun_infer.plugins.torch_ops import kernels

#: every flaky allocator and ops provider made in this process (test inspection only)
ALLOCATORS: list[FlakyMemory] = []
PROVIDERS: list[FlakyOps] = []


class InjectedFault(RuntimeError):
    """What the flaky plugin raises on purpose."""


@dataclasses.dataclass
class FlakyMemoryConfig(MemoryConfig):
    name: str = "flaky"
    #: the allocate call (1-based) that raises; 0 = never
    fail_at: int = 0


@dataclasses.dataclass
class FlakyOpsConfig(OpsConfig):
    name: str = "flaky"
    #: the op whose ``fail_at``-th call (1-based) raises on the rank ``fail_rank``; "" = none
    fail_op: str = ""
    fail_at: int = 0
    fail_rank: int = 0


@dataclasses.dataclass
class FlakyCommConfig(CommConfig):
    name: str = "flaky"
    #: the all_reduce call (1-based) on rank 0 that raises; 0 = never
    fail_at: int = 0


class FlakyMemory(MemoryAllocator):
    """The built-in simple allocator, counting live tensors, failing on one chosen call."""

    name = "flaky"

    def __init__(self, inner: SimpleAllocator, fail_at: int) -> None:
        self.inner = inner
        self.fail_at = fail_at
        self.calls = 0
        self.live: dict[int, Any] = {}

    def allocate(self, shape, dtype):
        self.calls += 1
        if self.calls == self.fail_at:
            raise InjectedFault(f"injected fault in allocate call {self.calls}")
        tensor = self.inner.allocate(shape, dtype)
        self.live[tensor.data_ptr()] = tensor.shape
        return tensor

    def free(self, tensor):
        self.live.pop(tensor.data_ptr(), None)
        self.inner.free(tensor)

    def stats(self):
        return self.inner.stats()

    def empty_cache(self):
        self.inner.empty_cache()


class FlakyOps(DictOpsProvider):
    """Plain-torch kernels; :meth:`arm` makes one future call of one op raise."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        self._armed: tuple[str, int] | None = None
        super().__init__({op: self._wrap(op, fn) for op, fn in kernels().items()}, name="flaky")

    def arm(self, op: str, after: int = 1) -> None:
        """The ``after``-th call of ``op`` from now raises :class:`InjectedFault` (once)."""
        self._armed = (op, self.calls.get(op, 0) + after)

    def _wrap(self, op: str, fn):
        def kernel(*args, **kwargs):
            self.calls[op] = n = self.calls.get(op, 0) + 1
            if self._armed == (op, n):
                self._armed = None
                raise InjectedFault(f"injected fault in {op} call {n}")
            return fn(*args, **kwargs)

        return kernel


class FlakyComm(GlooComm):
    """Gloo collectives; rank 0's ``fail_at``-th all_reduce raises."""

    name = "flaky"

    def __init__(self, fail_at: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.fail_at = fail_at
        self.all_reduces = 0

    def all_reduce(self, tensor, accumulate_dtype=None):
        self.all_reduces += 1
        if self.rank == 0 and self.all_reduces == self.fail_at:
            raise InjectedFault(f"injected fault in all_reduce call {self.all_reduces}")
        return super().all_reduce(tensor, accumulate_dtype=accumulate_dtype)


def make_memory(*, config, device):
    allocator = FlakyMemory(SimpleAllocator(device=device), int(config.fail_at))
    ALLOCATORS.append(allocator)
    return allocator


def make_ops(*, config, device):
    provider = FlakyOps()
    PROVIDERS.append(provider)
    fail_op = config.get("fail_op", "") if config is not None else ""
    if fail_op and device is not None and getattr(device, "index", 0) == int(config.fail_rank):
        provider.arm(fail_op, after=int(config.fail_at))
    return provider


@hookimpl
def kunlun_infer_plugin_info():
    return PluginInfo(name="flaky", version="0.0.1", api=">=1.0,<2", capabilities=("memory", "ops", "comm"))


@hookimpl
def kunlun_infer_memory_factories():
    return {"flaky": make_memory}


@hookimpl
def kunlun_infer_ops_factories():
    return {"flaky": make_ops}


@hookimpl
def kunlun_infer_comm_factories():
    return {"flaky": lambda *, config, device: FlakyComm(int(config.fail_at))}


@hookimpl
def kunlun_infer_config_options():
    return [ConfigOption("memory", "flaky", FlakyMemoryConfig), ConfigOption("ops", "flaky", FlakyOpsConfig),
            ConfigOption("comm", "flaky", FlakyCommConfig)]
