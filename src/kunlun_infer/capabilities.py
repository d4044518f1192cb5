"""The five capability interfaces a plugin implements (device, memory, ops, comm, streams), and logits processors.

The framework talks to hardware only through these classes. A plugin returns
instances of subclasses from the factories it registers in ``hookspecs.py``;
the runtime composes one of each into a :class:`kunlun_infer.runtime.Runtime`.
Tensors are ``torch.Tensor`` objects on ``Device.torch_device``: torch is the
common currency between the framework and every chip's stack. A logits
processor (hook API 1.2) is not a capability of a chip but an engine
extension: it constrains what sequences may generate (structured output).
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from kunlun_infer.config import COMM_TIMEOUT_S
from kunlun_infer.ops import OP_SPECS
from kunlun_infer.ops.attention import AttentionBackend, AttentionSpec

# --------------------------------------------------------------------------- device


class Device(abc.ABC):
    """One accelerator (or host) as the framework sees it.

    ``open``/``close`` are reference counted and thread-safe: every ``open``
    needs a matching ``close``; the last ``close`` releases the context. A
    device may be opened again after it was fully closed.
    """

    #: registered option name of the plugin that made this device (``cpu``, ``simchip`` …)
    name: str = "device"

    @property
    @abc.abstractmethod
    def torch_device(self) -> torch.device:
        """The ``torch.device`` on which tensors for this device live."""

    @abc.abstractmethod
    def open(self) -> None:
        """Acquire the device context (idempotent per call pair, thread-safe)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release one ``open``; the last release frees the context."""

    @property
    @abc.abstractmethod
    def is_open(self) -> bool:
        """True while at least one ``open`` is outstanding."""

    @abc.abstractmethod
    def identity(self) -> dict[str, Any]:
        """Facts that identify the device: ``name``, ``vendor``, ``index``, ``model`` …"""

    @abc.abstractmethod
    def supported_dtypes(self) -> frozenset[torch.dtype]:
        """Floating dtypes this device computes in natively."""

    @abc.abstractmethod
    def mem_get_info(self) -> tuple[int, int]:
        """``(free_bytes, total_bytes)`` of device memory available to this process."""

    def stack_versions(self) -> dict[str, str]:
        """Versions of the software stack beneath (driver, runtime, torch …)."""
        return {"torch": torch.__version__}

    def synchronize(self) -> None:
        """Wait for all work queued on this device to finish."""

    def __enter__(self) -> Device:
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------- memory


@dataclasses.dataclass(frozen=True)
class MemoryStats:
    """Allocator statistics, all in bytes except ``fragmentation`` (0..1).

    ``allocated``: bytes in live allocations (as requested, after rounding to
    the granularity); ``reserved``: bytes held from the device, live or cached;
    ``peak``: the high-water mark of ``allocated``; ``fragmentation``: share of
    ``reserved`` that is cached but not live (``1 - allocated/reserved``).
    """

    allocated: int
    reserved: int
    peak: int
    fragmentation: float
    num_allocs: int = 0
    num_cache_hits: int = 0


class MemoryAllocator(abc.ABC):
    """Hands out device tensors honouring the device's alignment and granularity."""

    name: str = "memory"
    #: every allocation's start address is a multiple of this many bytes
    alignment: int = 64
    #: every allocation's size is rounded up to a multiple of this many bytes
    granularity: int = 512

    @abc.abstractmethod
    def allocate(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """Return an uninitialised tensor of ``shape``/``dtype`` on the device.

        Raises :class:`kunlun_infer.errors.DeviceOutOfMemoryError` with the
        requested and free byte counts when the device cannot satisfy it.
        """

    @abc.abstractmethod
    def free(self, tensor: torch.Tensor) -> None:
        """Return a tensor obtained from ``allocate``; using it afterwards is undefined."""

    @abc.abstractmethod
    def stats(self) -> MemoryStats:
        """Current statistics."""

    def empty_cache(self) -> None:
        """Give cached, unused blocks back to the device. The loader calls it once a model's weights are in place
        (what loading freed goes back before the engine measures a step's activations)."""

    def reset_peak(self) -> None:
        """Restart the ``peak`` high-water mark from the current ``allocated``."""

    def round_size(self, nbytes: int) -> int:
        """Bytes actually reserved for a request of ``nbytes``."""
        g = self.granularity
        return max(g, (nbytes + g - 1) // g * g)


# --------------------------------------------------------------------------- ops


class OpsProvider(abc.ABC):
    """A table of named kernels for one device type.

    Op names and signatures are fixed by :mod:`kunlun_infer.ops` (each has a
    plain-torch reference there). A provider may implement any subset; the
    runtime falls back to the reference for the rest unless ``ops.strict``.
    """

    name: str = "ops"

    @abc.abstractmethod
    def supports(self, op: str) -> bool:
        """True when this provider implements ``op`` for its device."""

    @abc.abstractmethod
    def get(self, op: str) -> Callable[..., Any]:
        """The kernel for ``op``; only called when ``supports(op)`` is true."""

    def available(self) -> list[str]:
        """Names of every op this provider implements."""
        return [op for op in OP_SPECS if self.supports(op)]

    def attention_backend(self, spec: AttentionSpec) -> AttentionBackend | None:
        """This provider's attention backend for ``spec``, or ``None`` to use the reference backend.

        The reference backend (:mod:`kunlun_infer.ops.reference_attention`)
        keeps the 1.0 cache layout and calls this provider's ``store_kv`` and
        ``paged_attention`` (or their references). A provider with kernels of
        its own layout returns an :class:`~kunlun_infer.ops.attention.AttentionBackend`
        (see that module for the contract); it may return ``None`` for a
        ``spec.kind`` or dtype it does not serve. For ``spec.kind == "mla"``
        (since 1.4) the backend must be an
        :class:`~kunlun_infer.ops.attention.MLAAttentionBackend`; without one
        the framework's reference MLA backend serves. Called once per model
        load, also with ``device=None`` providers (sizing only): it must not
        touch hardware. Added in 1.1.
        """
        return None

    def capture(self, fn: Callable[[], Any]) -> CapturedStep | None:
        """``fn`` run once and captured, so that :meth:`CapturedStep.replay` repeats its kernels; ``None``: not here.

        ``fn`` is one forward of the model's layers over buffers that stay
        put: the engine's input buffers (hidden states, positions, the
        attention metadata of :meth:`AttentionBackendBase.update_metadata`),
        the weights and the KV cache. Between replays the engine writes new
        contents into those buffers; a replay must read them, and rewrite the
        tensors of ``CapturedStep.result`` in place. Return ``None`` when ``fn``
        does work a replay would not repeat (the default: this provider does
        not capture; every step then runs eagerly). Added in 1.5.
        """
        return None


class DictOpsProvider(OpsProvider):
    """An ops provider backed by a ``{name: kernel}`` mapping."""

    def __init__(self, kernels: Mapping[str, Callable[..., Any]], name: str = "ops") -> None:
        self._kernels = dict(kernels)
        self.name = name

    def supports(self, op: str) -> bool:
        return op in self._kernels

    def get(self, op: str) -> Callable[..., Any]:
        return self._kernels[op]


class CapturedStep(abc.ABC):
    """What :meth:`OpsProvider.capture` returns: the region's outputs and a way to run it again (hook API 1.5)."""

    #: the value ``fn`` returned at capture; every replay rewrites its tensors in place
    result: Any

    @abc.abstractmethod
    def replay(self) -> Any:
        """Launch the captured kernels again on the current contents of the inputs; returns :attr:`result`.

        Raise when a kernel reports a failure: the engine then runs the step
        eagerly, which reports the kernel's own error.
        """


# --------------------------------------------------------------------------- comm


class Comm(abc.ABC):
    """Collectives among the ranks of one engine (its tensor- and pipeline-parallel ranks).

    ``init`` must be called once before any collective. Collectives are
    blocking from the caller's point of view unless the streams plugin runs
    them on a comm stream (see :class:`Streams`).
    """

    name: str = "comm"
    rank: int = 0
    world_size: int = 1

    @abc.abstractmethod
    def init(self, *, rank: int, world_size: int, init_method: str | None = None,
             timeout_s: float = COMM_TIMEOUT_S) -> None:
        """Join the group as ``rank`` of ``world_size``.

        ``init_method`` is a ``torch.distributed`` init URL (``tcp://…``,
        ``env://``); ``None`` means ``env://``. Must match the process layout.
        """

    @abc.abstractmethod
    def all_reduce(self, tensor: torch.Tensor, accumulate_dtype: torch.dtype | None = None) -> torch.Tensor:
        """Sum ``tensor`` across ranks; returns the sum (may be ``tensor`` itself, updated in place).

        When ``accumulate_dtype`` is wider than ``tensor.dtype`` the reduction
        is carried out in ``accumulate_dtype`` and cast back. ``None`` (what
        the framework passes) means the plugin's own setting, which its factory
        read from ``comm.accumulate_dtype`` (``none`` there: no widening).
        """

    @abc.abstractmethod
    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's ``tensor`` along ``dim`` in rank order."""

    @abc.abstractmethod
    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Copy ``src``'s tensor into every rank's ``tensor`` (in place)."""

    def all_to_all(self, tensor: torch.Tensor, send_splits: Sequence[int],
                   recv_splits: Sequence[int]) -> torch.Tensor:
        """Exchange rows: the first ``send_splits[0]`` rows (dim 0) of ``tensor`` go to rank 0, the next
        ``send_splits[1]`` to rank 1, …; returns the rows received, rank 0's first, ``recv_splits[i]`` of them
        from rank ``i`` (each rank's ``recv_splits[i]`` is rank ``i``'s ``send_splits`` entry for it).

        Used by expert parallelism (``parallel.expert_size``) to send tokens to the ranks owning their
        experts and the results back. This default, for comm plugins written before hook API 1.4, is built
        on :meth:`all_gather` (every rank's split sizes, then every rank's rows padded to the longest): it
        moves ``world_size`` times the data a native all-to-all moves. Plugins override it.
        """
        if self.world_size == 1:
            return tensor
        ranks = self.world_size
        counts = torch.tensor(list(send_splits), dtype=torch.int64, device=tensor.device)
        table = self.all_gather(counts.view(1, ranks), dim=0).tolist()  # table[i][j]: rows rank i sends rank j
        longest = max(sum(row) for row in table)
        padded = tensor.new_zeros((longest, *tensor.shape[1:]))
        padded[:tensor.shape[0]] = tensor
        gathered = self.all_gather(padded.unsqueeze(0), dim=0)  # [ranks, longest, ...]
        parts = [gathered[i, sum(table[i][:self.rank]):sum(table[i][:self.rank + 1])] for i in range(ranks)]
        if [p.shape[0] for p in parts] != list(recv_splits):
            raise ValueError(f"all_to_all: rank {self.rank} expected {list(recv_splits)} rows, the ranks send "
                             f"{[p.shape[0] for p in parts]}")
        return torch.cat(parts)

    @abc.abstractmethod
    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Send a picklable control-plane object from ``src``; returns it on every rank."""

    @abc.abstractmethod
    def barrier(self) -> None:
        """Wait until every rank arrives."""

    @abc.abstractmethod
    def destroy(self) -> None:
        """Leave the group and release its resources."""

    def buffer_bytes(self) -> int:
        """Device memory this comm plugin keeps for its buffers (for the memory plan)."""
        return 0

    # -- hook API 1.9: collectives inside captured steps; optional, default "no"

    @property
    def capturable(self) -> bool:
        """Whether :meth:`all_reduce` may run inside the ops plugin's capture of a step (1.9).

        ``True`` promises that an all-reduce of a contiguous float32 or
        bfloat16 tensor called while :meth:`OpsProvider.capture` watches is
        made of work that capture records and replays with the step's
        kernels (the ``gloo`` comm on one host: one native call over shared
        memory, which the ``cpu`` ops record), and that any other all-reduce
        makes the capture refuse. The engine then captures a
        tensor-parallel rank's decode steps like one rank's; every rank of
        the group captures and replays the same steps. ``False``, the
        default: the tensor-parallel steps run eagerly, as before 1.9.
        """
        return False

    # -- hook API 1.4: point to point and subgroups (pipeline parallelism); optional, with refusing defaults

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        """Send ``tensor`` to rank ``dst`` of this group (1.4).

        Returns once ``tensor`` may be reused (it may wait for ``dst`` to
        post the matching :meth:`recv`). Messages between two ranks arrive in
        the order they were sent. A comm without it cannot serve pipeline
        parallelism; the default says so.
        """
        raise NotImplementedError(point_to_point_missing(self))

    def recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """Fill ``tensor`` (its shape and dtype must match the sent one) with the next message from ``src`` (1.4).

        Returns ``tensor``. Bounded by the group's ``timeout_s``: a peer that
        never sends makes it raise an error whose text says it timed out.
        """
        raise NotImplementedError(point_to_point_missing(self))

    def subgroup(self, ranks: Sequence[int]) -> Comm:
        """A Comm over ``ranks`` of this group (ascending), whose own rank 0 is ``ranks[0]`` (1.4).

        Every rank in ``ranks`` calls it (ranks outside need not); the
        collectives of the returned Comm involve those ranks only. It is
        destroyed with this one. Used to give each pipeline stage its own
        tensor-parallel group.
        """
        raise NotImplementedError(point_to_point_missing(self))


def point_to_point_missing(comm: Comm) -> str:
    """Why ``comm`` cannot serve pipeline parallelism (its plugin predates hook API 1.4's send/recv/subgroup)."""
    return (f"comm={comm.name} ({type(comm).__name__}) has no point-to-point send/recv or subgroups (hook API "
            "1.4); pipeline parallelism (parallel.pipeline_size > 1) needs them: choose comm=gloo or a comm "
            "plugin that supports hook API 1.4")


def has_point_to_point(comm: Comm) -> bool:
    """True when ``comm`` (or the plugin object a guard wraps) implements ``send``, ``recv`` and ``subgroup``."""
    inner = getattr(comm, "inner", comm)
    return all(getattr(type(inner), name) is not getattr(Comm, name) for name in ("send", "recv", "subgroup"))


# --------------------------------------------------------------------------- streams


class Event(abc.ABC):
    """A marker in a stream's queue of work."""

    @abc.abstractmethod
    def query(self) -> bool:
        """True when all work recorded before this event has finished."""

    @abc.abstractmethod
    def synchronize(self) -> None:
        """Block the host until the event completes."""


class Stream(abc.ABC):
    """An ordered queue of device work.

    ``submit(fn, *args)`` enqueues ``fn(*args)``; functions on one stream run
    in submission order. Work on different streams may overlap; ordering
    between streams is expressed with events (``record_event``/``wait_event``).
    """

    @abc.abstractmethod
    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Enqueue ``fn(*args)``; returns without waiting (it may run immediately)."""

    @abc.abstractmethod
    def record_event(self) -> Event:
        """An event that completes when everything submitted so far has run."""

    @abc.abstractmethod
    def wait_event(self, event: Event) -> None:
        """Later work on this stream starts only after ``event`` completes."""

    @abc.abstractmethod
    def synchronize(self) -> None:
        """Block the host until everything submitted has run; re-raises the first error."""


class Streams(abc.ABC):
    """Provides the compute stream and, where the device has one, a separate comm stream."""

    name: str = "streams"

    @abc.abstractmethod
    def compute_stream(self) -> Stream:
        """The stream on which model computation runs."""

    @abc.abstractmethod
    def comm_stream(self) -> Stream:
        """The stream for collectives; may be the compute stream itself."""

    @property
    def overlaps(self) -> bool:
        """True when the comm stream is distinct and can overlap compute."""
        return self.comm_stream() is not self.compute_stream()

    @property
    def asynchronous(self) -> bool:
        """True when kernels called on the compute stream run after the call returns (a GPU's queue), so the
        host can prepare the next step while the device runs this one (hook API 1.7; the engine then overlaps
        steps, ``scheduler.overlap_steps=auto``). False, the default: every kernel has run when it
        returns, as on a host CPU."""
        return False

    def synchronize(self) -> None:
        """Wait for every stream of this provider."""
        self.compute_stream().synchronize()
        if self.overlaps:
            self.comm_stream().synchronize()

    def close(self) -> None:
        """Stop any worker threads; the provider is unusable afterwards."""


# --------------------------------------------------------------------------- logits processors (hook API 1.2)


@dataclasses.dataclass(frozen=True)
class LogitsProcessorContext:
    """What a logits-processor factory is given (more fields may be added, never removed).

    ``config``: the composed ``structured`` config node. ``tokenizer``: the
    model's ``tokenizers.Tokenizer`` (the Hugging Face fast-tokenizer
    pipeline of its ``tokenizer.json``). ``vocab_size``: the width of the
    logits rows (the model's vocabulary, which may exceed the tokenizer's).
    ``eos_token_ids``: the model's EOS tokens. ``torch_device``: where the
    logits live. ``ops``: the run's op table, resolved for
    ``apply_token_bitmask`` (``ops.apply_token_bitmask(logits, bitmask,
    rows)``), so a bitmask-based processor masks on the device with the ops
    plugin's kernel.
    """

    config: Any
    tokenizer: Any
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    torch_device: torch.device
    ops: Any


class ConstraintState(abc.ABC):
    """Where one sequence stands in its constraint; the engine keeps it in step with the sequence's tokens."""

    @abc.abstractmethod
    def accept(self, token_id: int) -> bool:
        """Advance by one generated token; False (state unchanged) if the constraint forbids it."""

    @abc.abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (tokens the engine took back)."""


class LogitsProcessor(abc.ABC):
    """Constrains what a sequence may generate next by editing its logits row every step.

    The engine calls :meth:`compile` once per distinct constraint of a
    request (and caches the result), :meth:`new_state` once per sequence,
    and :meth:`apply` once per step with every constrained row of the
    batch. It advances each state by every token its sequence accepts and
    rolls it back when the engine takes tokens back, before the next
    :meth:`apply`. All calls come from the engine's thread.
    """

    #: registered name (the ``structured.backend`` option that chose it)
    name: str = "logits"

    @abc.abstractmethod
    def compile(self, spec: Any) -> Any:
        """Prepare a :class:`kunlun_infer.engine.structured_output.StructuredOutput` for use.

        :raises kunlun_infer.errors.RequestError: (field ``structured``) for a
            constraint this processor cannot serve: an invalid schema, regex or
            grammar, or a kind it does not support.
        """

    @abc.abstractmethod
    def new_state(self, compiled: Any, *, stop_token_ids: frozenset[int]) -> ConstraintState:
        """A fresh state at the start of the constrained text; ``stop_token_ids`` end the sequence."""

    @abc.abstractmethod
    def apply(self, logits: torch.Tensor, rows: Sequence[int], states: Sequence[ConstraintState]) -> None:
        """Set ``logits[rows[i]]`` to ``-inf`` (in place) for every token ``states[i]`` forbids next.

        ``logits`` is ``[N, vocab_size]`` on the device. A state whose text is
        complete allows only its stop tokens.
        """

    def close(self) -> None:
        """Release what the processor holds (threads, caches); called when the engine closes."""
