"""Paged KV block bookkeeping: allocation, freeing, prefix sharing and LRU eviction."""

from kunlun_infer.engine.block_manager import BlockManager
from kunlun_infer.engine.params import SamplingParams
from kunlun_infer.engine.sequence import Sequence


def make_seq(tokens, seq_id=0):
    return Sequence(seq_id, f"r{seq_id}", list(tokens), SamplingParams(max_tokens=4))


def run_prefill(bm, seq):
    """Take the cached prefix, allocate the rest, pretend it was computed."""
    prefix = bm.match_prefix(seq)
    num_new = len(seq) - len(prefix) * bm.block_size
    assert bm.can_allocate(seq, num_new, prefix)
    bm.take_prefix(seq, prefix)
    bm.allocate(seq, num_new)
    seq.num_computed_tokens += num_new
    bm.commit(seq)
    return len(prefix) * bm.block_size


def test_allocate_and_free_returns_every_block():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq(range(10))
    run_prefill(bm, seq)
    assert len(seq.block_table) == 3
    assert bm.num_free_blocks == 5
    bm.free(seq)
    assert bm.num_free_blocks == 8 and seq.block_table == []


def test_can_allocate_refuses_beyond_free_blocks():
    bm = BlockManager(num_blocks=2, block_size=4)
    seq = make_seq(range(9))
    assert not bm.can_allocate(seq, 9)
    assert bm.can_allocate(seq, 8)


def test_shared_prefix_is_taken_by_reference_and_leaves_last_token_to_compute():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = make_seq(range(12), 0)
    run_prefill(bm, a)
    b = make_seq(list(range(8)) + [99, 98, 97], 1)
    assert run_prefill(bm, b) == 8
    assert b.block_table[:2] == a.block_table[:2]
    # an identical prompt reuses all but its last block: the last token must be computed
    c = make_seq(range(12), 2)
    assert run_prefill(bm, c) == 8
    bm.free(a)
    bm.free(b)
    bm.free(c)
    assert bm.num_free_blocks == 16


def test_freed_prefix_survives_until_evicted_least_recently_used():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = make_seq([1, 2, 3, 4, 5], 0)
    run_prefill(bm, a)
    bm.free(a)
    assert bm.num_free_blocks == 4
    again = make_seq([1, 2, 3, 4, 9], 1)
    assert run_prefill(bm, again) == 4
    bm.free(again)
    # fill the whole cache with other tokens: the old prefix is evicted
    other = make_seq([7] * 8, 2)
    run_prefill(bm, other)
    bm.free(other)
    assert bm.match_prefix(make_seq([1, 2, 3, 4, 5], 3)) == []


def test_prefix_caching_off_never_shares():
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    a = make_seq([1, 2, 3, 4, 5], 0)
    run_prefill(bm, a)
    assert run_prefill(bm, make_seq([1, 2, 3, 4, 5], 1)) == 0


def test_can_allocate_counts_cached_prefix_blocks_taken_from_the_free_queue():
    bm = BlockManager(num_blocks=3, block_size=2)
    a = make_seq([1, 2, 3, 4, 5], 0)
    run_prefill(bm, a)
    bm.free(a)
    b = make_seq([1, 2, 3, 4, 6, 7, 8], 1)
    prefix = bm.match_prefix(b)
    assert len(prefix) == 2
    # 7 tokens need 4 blocks; 2 come from the cache, only 1 other block remains free
    assert not bm.can_allocate(b, 3, prefix)
    assert bm.can_allocate(b, 2, prefix)
