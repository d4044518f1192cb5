"""The paged KV cache's bookkeeping: which block holds which tokens, and who uses it.

Blocks are ids into the per-layer K/V tensors. A block in use has a
reference count; a block nobody uses sits in the free queue. With prefix
caching, a block that fills up with computed tokens is registered under the
hash of its token chain (its own tokens and the hash of the block before),
so a later sequence starting with the same tokens takes it by reference
instead of recomputing it; a sequence forked off another shares its full
blocks the same way (:meth:`BlockManager.fork`). Freed blocks keep their
registration while they wait in the free queue and are evicted least-recently-used: a block is
forgotten only when the queue hands it out again. Hash collisions are
guarded by comparing the block's tokens on every hit.
"""

from __future__ import annotations

from collections import OrderedDict

from kunlun_infer.engine.sequence import Sequence

#: hash of the (empty) chain before a sequence's first block
_ROOT_HASH = hash(("kunlun_infer.prefix",))


class BlockManager:
    """Free queue, reference counts and the prefix-cache index over ``num_blocks`` KV blocks."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_counts = [0] * num_blocks
        self._hash_of_block: list[int | None] = [None] * num_blocks
        self._tokens_of_block: list[tuple[int, ...] | None] = [None] * num_blocks
        #: blocks with no users, least recently used first
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        #: chain hash -> block holding those tokens
        self._cached: dict[int, int] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence uses (some may still hold reusable cached prefixes)."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    # ------------------------------------------------------------------ prefix cache

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding the longest run of ``seq``'s leading full blocks.

        At least one token is always left to compute, since the model must
        produce the logits of the last one. A sequence asking for
        ``prompt_logprobs`` matches nothing: each of its prompt tokens must be
        scored. Takes no references.
        """
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return []
        tokens = seq.token_ids
        max_blocks = (len(tokens) - 1) // self.block_size
        parent, hits = _ROOT_HASH, []
        for i in range(max_blocks):
            block_tokens = tuple(tokens[i * self.block_size:(i + 1) * self.block_size])
            parent = hash((parent, block_tokens))
            block = self._cached.get(parent)
            if block is None or self._tokens_of_block[block] != block_tokens:
                break
            hits.append(block)
        return hits

    def can_allocate(self, seq: Sequence, num_new_tokens: int, prefix: list[int] = ()) -> bool:
        """Whether ``seq`` (after taking ``prefix``) can get blocks for ``num_new_tokens`` more tokens."""
        total = seq.num_computed_tokens + len(prefix) * self.block_size + num_new_tokens
        needed = self.blocks_for(total) - len(seq.block_table) - len(prefix)
        free = self.num_free_blocks - sum(1 for b in prefix if self._ref_counts[b] == 0)
        return needed <= free

    def take_prefix(self, seq: Sequence, prefix: list[int]) -> None:
        """Give a fresh ``seq`` the cached ``prefix`` blocks; their tokens count as computed."""
        assert not seq.block_table and seq.num_computed_tokens == 0, "prefix goes to a fresh sequence"
        for block in prefix:
            if self._ref_counts[block] == 0:
                del self._free[block]
            self._ref_counts[block] += 1
            seq.block_hashes.append(self._hash_of_block[block])  # type: ignore[arg-type]
        seq.block_table = list(prefix)
        seq.num_computed_tokens = len(prefix) * self.block_size

    # ------------------------------------------------------------------ allocate / free

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Append blocks to ``seq`` so ``num_new_tokens`` more tokens fit; check ``can_allocate`` first."""
        needed = self.blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        if needed > self.num_free_blocks:
            raise RuntimeError(f"{seq!r} needs {needed} KV blocks, {self.num_free_blocks} free")
        for _ in range(needed):
            seq.block_table.append(self._take_free_block())

    def _take_free_block(self) -> int:
        block, _ = self._free.popitem(last=False)
        old_hash = self._hash_of_block[block]
        if old_hash is not None:
            if self._cached.get(old_hash) == block:
                del self._cached[old_hash]
            self._hash_of_block[block] = None
            self._tokens_of_block[block] = None
        self._ref_counts[block] = 1
        return block

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s references; unused blocks go to the free queue, cached ones kept for reuse.

        Blocks are queued tail first, so a sequence's last blocks (the least
        likely to be shared) are evicted before its first ones; blocks that
        hold no cached prefix go to the front, to be handed out first.
        """
        for block in reversed(seq.block_table):
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                self._free[block] = None
                if self._hash_of_block[block] is None:
                    self._free.move_to_end(block, last=False)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Free ``seq``'s blocks past the first ``num_tokens`` tokens (KV written for drafts it did not keep).

        Only blocks beyond the computed tokens can go: those hold no cached prefix.
        """
        keep = max(self.blocks_for(num_tokens), self.blocks_for(seq.num_computed_tokens))
        for block in reversed(seq.block_table[keep:]):
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                self._free[block] = None
                self._free.move_to_end(block, last=False)
        del seq.block_table[keep:]

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Give ``child`` (a fresh sequence of ``parent``'s prompt) the parent's full computed blocks by reference.

        The tokens of a partly filled last block are left for the child to
        recompute (fewer than ``block_size`` of them, in its next step): its
        own next tokens must go to a block of its own, and recomputing that
        tail needs no device-side copy, so forking works unchanged on every
        device plugin and across tensor-parallel ranks.
        """
        assert not child.block_table and child.num_computed_tokens == 0, "fork into a fresh sequence"
        num_full = parent.num_computed_tokens // self.block_size
        shared = parent.block_table[:num_full]
        for block in shared:
            self._ref_counts[block] += 1
        child.block_table = list(shared)
        child.block_hashes = list(parent.block_hashes[:num_full])
        child.num_computed_tokens = num_full * self.block_size

    def commit(self, seq: Sequence, num_tokens: int | None = None) -> None:
        """Register the blocks of ``seq`` that became full of computed tokens in the prefix cache (of its first
        ``num_tokens`` tokens only, when given: those known on the host while a later step is in flight)."""
        if not self.enable_prefix_caching:
            return
        num_full = (seq.num_computed_tokens if num_tokens is None else num_tokens) // self.block_size
        parent = seq.block_hashes[-1] if seq.block_hashes else _ROOT_HASH
        for i in range(len(seq.block_hashes), num_full):
            block_tokens = tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
            parent = hash((parent, block_tokens))
            seq.block_hashes.append(parent)
            block = seq.block_table[i]
            if parent not in self._cached and self._hash_of_block[block] is None:
                self._cached[parent] = block
                self._hash_of_block[block] = parent
                self._tokens_of_block[block] = block_tokens
