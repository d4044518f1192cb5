"""The engine's neutral description of one step's attention work, from which a backend builds its metadata.

The flat batch of a step lays the new tokens of its sequences end to end.
:class:`AttentionStep` says, in plain host lists and in flat-batch order,
how many new tokens each sequence has (``query_lens``), how many of its
tokens are already in the cache (``context_lens``), which cache blocks it
owns (``block_tables``) and in which cache slot each new token's key and
value go (``slot_mapping``, ``block * block_size + offset``). Every other
figure a kernel may want — sequence lengths, cumulative offsets, which
sequences are prefills, chunked prefills or decodes — is derived here, so
each backend makes the tensors it needs (int32 or int64, host and device
copies, padded tables) without the engine knowing about them.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import itertools
from collections.abc import Sequence

import numpy as np
import torch

from kunlun_infer.ops.upload import upload


class SeqKind(str, enum.Enum):
    """What attention one sequence of the step needs (a fact of its lengths, not of its request's phase)."""

    #: one new token over the cached context (a generated token, or the one uncached token of a prompt)
    DECODE = "decode"
    #: several new tokens and nothing cached before them: a prompt, or its first chunk
    PREFILL = "prefill"
    #: several new tokens after a cached context: a later prompt chunk, or a prompt after a prefix-cache hit
    CHUNKED_PREFILL = "chunked_prefill"


def seq_kind(query_len: int, context_len: int) -> SeqKind:
    """The :class:`SeqKind` of a sequence with ``query_len`` new and ``context_len`` cached tokens."""
    if query_len == 1:
        return SeqKind.DECODE
    return SeqKind.PREFILL if context_len == 0 else SeqKind.CHUNKED_PREFILL


def decodes_first(query_lens: Sequence[int], context_lens: Sequence[int] | None = None) -> list[int]:
    """A batch order with every one-token (decode) sequence first, each group in its original order."""
    decodes = [i for i, n in enumerate(query_lens) if n == 1]
    return decodes + [i for i, n in enumerate(query_lens) if n != 1]


@dataclasses.dataclass(frozen=True, eq=False)
class AttentionStep:
    """One step's sequences, in flat-batch order, as host lists.

    ``query_lens[i]``: new tokens of sequence ``i`` in this step (>= 1);
    its tokens are rows ``query_start_loc[i]:query_start_loc[i + 1]`` of the
    flat batch. ``context_lens[i]``: its tokens already in the cache before
    this step. ``block_tables[i]``: its cache block ids in order, covering at
    least ``seq_lens[i]`` tokens. ``slot_mapping[t]``: the cache slot
    (``block * block_size + offset``) of flat-batch token ``t``.
    ``device``: where the model's tensors live (put device copies there).
    """

    block_size: int
    query_lens: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]
    slot_mapping: list[int]
    device: torch.device = dataclasses.field(default_factory=lambda: torch.device("cpu"))

    def __post_init__(self) -> None:
        n = len(self.query_lens)
        if len(self.context_lens) != n or len(self.block_tables) != n:
            raise ValueError(f"AttentionStep: {n} query lengths, {len(self.context_lens)} context lengths and "
                             f"{len(self.block_tables)} block tables; one of each per sequence")
        if len(self.slot_mapping) != sum(self.query_lens):
            raise ValueError(f"AttentionStep: {len(self.slot_mapping)} slots for {sum(self.query_lens)} new tokens")

    # ------------------------------------------------------------------ sizes

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return len(self.slot_mapping)

    @functools.cached_property
    def seq_lens(self) -> list[int]:
        """Tokens of each sequence once this step's are stored: context + query."""
        return [c + q for c, q in zip(self.context_lens, self.query_lens)]

    @functools.cached_property
    def query_start_loc(self) -> list[int]:
        """``[0, q0, q0 + q1, …]`` (``num_seqs + 1`` numbers): where each sequence's tokens start."""
        starts = [0]
        for n in self.query_lens:
            starts.append(starts[-1] + n)
        return starts

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens, default=0)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens, default=0)

    # ------------------------------------------------------------------ kinds

    @functools.cached_property
    def kinds(self) -> list[SeqKind]:
        """The :class:`SeqKind` of every sequence."""
        return [seq_kind(q, c) for q, c in zip(self.query_lens, self.context_lens)]

    @property
    def is_decode_only(self) -> bool:
        return self.num_tokens == self.num_seqs

    @functools.cached_property
    def num_leading_decodes(self) -> int:
        """How many sequences at the front of the batch are decodes (all of them, when ordered decodes first)."""
        count = 0
        for n in self.query_lens:
            if n != 1:
                break
            count += 1
        return count

    def padded_to(self, num_seqs: int) -> AttentionStep:
        """This decode step with padding sequences appended up to ``num_seqs``: one new token each, nothing
        cached, block table ``[0]`` and slot ``-1`` (a backend stores nothing for a negative slot; what the
        padding rows attend to is discarded). Used for captured steps of ``ops.step_graph_sizes``."""
        extra = num_seqs - self.num_seqs
        if extra < 0 or not self.is_decode_only:
            raise ValueError(f"AttentionStep.padded_to({num_seqs}): a decode step of {self.num_seqs} sequences "
                             f"can only grow")
        return AttentionStep(self.block_size, self.query_lens + [1] * extra, self.context_lens + [0] * extra,
                             self.block_tables + [[0]] * extra, self.slot_mapping + [-1] * extra, self.device)

    # ------------------------------------------------------------------ tensors

    def padded_block_tables(self, width: int | None = None, pad: int = 0) -> list[list[int]]:
        """:meth:`block_table_array` as lists."""
        return self.block_table_array(width, pad).tolist()

    def block_table_array(self, width: int | None = None, pad: int = 0) -> np.ndarray:
        """Block tables as rows of equal ``width`` (default: the longest table; longer tables are cut), filled
        with ``pad``: an int32 ``[num_seqs, width]`` array, built without padding lists in Python (a decode step
        of 256 sequences over 128-block tables is 33k numbers)."""
        lens = np.fromiter(map(len, self.block_tables), dtype=np.int64, count=self.num_seqs)
        width = int(lens.max(initial=0)) if width is None else width
        out = np.full((self.num_seqs, width), pad, dtype=np.int32)
        if width and self.num_seqs:
            lens = np.minimum(lens, width)
            flat = np.fromiter(itertools.chain.from_iterable(t[:width] for t in self.block_tables), dtype=np.int32,
                               count=int(lens.sum()))
            starts = np.cumsum(lens) - lens  # where each table's entries start in ``flat``
            out.ravel()[np.repeat(np.arange(self.num_seqs) * width - starts, lens) + np.arange(flat.size)] = flat
        return out

    def tensor(self, values: Sequence[int] | Sequence[Sequence[int]], dtype: torch.dtype = torch.int32,
               *, on_device: bool = True) -> torch.Tensor:
        """``values`` as a tensor of ``dtype``, on :attr:`device` (or on the host with ``on_device=False``)."""
        host = torch.tensor(values, dtype=dtype)
        return upload(host, self.device) if on_device else host
