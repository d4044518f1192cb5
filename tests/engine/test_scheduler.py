"""Continuous batching decisions: budgets, chunking, mixing, preemption, FCFS resume."""

from kunlun_infer.engine.block_manager import BlockManager
from kunlun_infer.engine.params import SamplingParams
from kunlun_infer.engine.scheduler import Scheduler
from kunlun_infer.engine.sequence import Sequence, SequenceStatus
from kunlun_infer.engine.stopping import stop_reason


def make_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, max_tokens=64, chunked=True, caching=True):
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=caching)
    return Scheduler(bm, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_tokens, chunked_prefill=chunked)


def add(sched, seq_id, prompt_len, max_tokens=4, first_token=0):
    seq = Sequence(seq_id, f"r{seq_id}", [first_token + seq_id * 1000 + i for i in range(prompt_len)],
                   SamplingParams(max_tokens=max_tokens))
    sched.add(seq)
    return seq


def step(sched):
    """One scheduling round with a fake model that always samples token 7; the sequences it finished."""
    batch = sched.schedule()
    sampled = [i for i, (s, n) in enumerate(zip(batch.seqs, batch.num_new_tokens))
               if s.num_computed_tokens + n == len(s)]
    sched.update(batch)
    finished = []
    for i in sampled:
        seq = batch.seqs[i]
        seq.append_token(7)
        reason = stop_reason(seq, None)
        if reason is not None:
            sched.finish(seq, reason)
            finished.append(seq)
    return batch, finished


def run_to_end(sched, limit=500):
    for _ in range(limit):
        if not sched.has_unfinished():
            return
        step(sched)
    raise AssertionError("scheduler did not finish")


def test_long_prompt_is_chunked_and_decodes_share_the_step():
    sched = make_scheduler(max_tokens=8)
    short = add(sched, 0, 3)
    step(sched)  # prefill of the short one
    long = add(sched, 1, 20)
    batch, _ = step(sched)
    assert batch.seqs == [short, long]
    assert batch.num_new_tokens == [1, 7]
    assert batch.num_decode_tokens == 1 and batch.num_prefill_tokens == 7
    assert long.num_computed_tokens == 7 and len(long) == 20  # nothing sampled mid-prompt


def test_without_chunking_a_prompt_waits_for_a_step_with_room():
    sched = make_scheduler(max_tokens=10, chunked=False)
    add(sched, 0, 6)
    add(sched, 1, 6)
    batch, _ = step(sched)
    assert [s.seq_id for s in batch.seqs] == [0]


def test_max_num_seqs_bounds_the_running_set():
    sched = make_scheduler(max_num_seqs=2)
    for i in range(5):
        add(sched, i, 3)
    batch, _ = step(sched)
    assert len(batch) == 2 and len(sched.waiting) == 3


def test_finished_sequences_return_their_blocks():
    sched = make_scheduler()
    for i in range(4):
        add(sched, i, 5 + i, max_tokens=3)
    run_to_end(sched)
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


def test_out_of_blocks_preempts_the_newest_and_resumes_it_first():
    # 6 blocks of 4 tokens; three sequences of 8 tokens growing by 8 need 12 blocks at the end
    sched = make_scheduler(num_blocks=6, max_tokens=64)
    seqs = [add(sched, i, 7, max_tokens=9) for i in range(3)]
    while sched.has_unfinished():
        step(sched)
        # preempted sequences wait in arrival order, ahead of any newer one
        assert list(sched.waiting) == sorted(sched.waiting, key=lambda s: s.seq_id)
    assert sched.num_preemptions > 0
    assert all(s.num_generated_tokens == 9 and s.finish_reason == "length" for s in seqs)
    assert sched.block_manager.num_free_blocks == 6


def test_preemption_picks_the_most_recent_arrival():
    sched = make_scheduler(num_blocks=4, max_tokens=64)
    old = add(sched, 0, 4, max_tokens=8)
    new = add(sched, 1, 4, max_tokens=8)
    while sched.num_preemptions == 0:
        step(sched)
    assert new.status is SequenceStatus.WAITING and old.status is SequenceStatus.RUNNING
    assert new.block_table == [] and new.num_computed_tokens == 0


def test_shared_prefix_counts_cache_hits():
    sched = make_scheduler(block_size=4)
    add(sched, 0, 1)  # unrelated
    a = Sequence(10, "a", list(range(100, 113)), SamplingParams(max_tokens=2))
    sched.add(a)
    run_to_end(sched)
    b = Sequence(11, "b", list(range(100, 113)) + [5], SamplingParams(max_tokens=2))
    sched.add(b)
    step(sched)
    assert b.num_cached_tokens == 12
    assert sched.prefix_cache_hit_tokens == 12


def test_abort_of_waiting_and_running_frees_at_once():
    sched = make_scheduler(max_num_seqs=1)
    running = add(sched, 0, 9)
    waiting = add(sched, 1, 3)
    step(sched)
    assert sched.block_manager.num_free_blocks < sched.block_manager.num_blocks
    sched.finish(running, "abort")
    sched.finish(waiting, "abort")
    assert not sched.has_unfinished()
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks
    assert running.finish_reason == "abort"


def test_a_sequence_is_admitted_with_the_slots_of_its_forks_which_they_take_over():
    sched = make_scheduler(max_num_seqs=4)
    parent = add(sched, 0, 5)
    parent.num_slots = 3  # two sequences will be forked off it
    later = add(sched, 1, 3)
    late_pair = add(sched, 2, 3)
    late_pair.num_slots = 2
    batch, _ = step(sched)
    assert batch.seqs == [parent, later]  # 3 + 1 slots: the pair waits
    children = [Sequence(10 + i, "r0", parent.token_ids[:5], parent.params) for i in range(2)]
    for child in children:
        sched.fork(parent, child)
    assert parent.num_slots == 1 and all(c.num_slots == 1 for c in children)
    assert [s.seq_id for s in sched.running] == [0, 1, 10, 11]
    assert all(c.block_table == parent.block_table[:1] and c.num_computed_tokens == 4 for c in children)
    batch, _ = step(sched)
    assert late_pair not in batch.seqs  # still 4 slots taken
    sched.finish(later, "abort")
    batch, _ = step(sched)
    assert late_pair not in batch.seqs  # 3 slots taken: the pair needs 2
    sched.finish(children[0], "abort")
    batch, _ = step(sched)
    assert late_pair in batch.seqs


def test_a_sequence_in_flight_is_neither_scheduled_again_nor_preempted_and_batches_take_a_share():
    # 2 blocks of 4 tokens: two 4-token prompts fill them, and the first decode needs a third
    sched = make_scheduler(num_blocks=2, max_num_seqs=4)
    old, new = add(sched, 0, 4, max_tokens=8), add(sched, 1, 4, max_tokens=8)
    first = sched.schedule(max_seqs=1)
    assert first.seqs == [old]  # at most its share
    second = sched.schedule(busy={old.seq_id}, max_seqs=1)
    assert second.seqs == [new]
    assert sched.schedule(busy={old.seq_id, new.seq_id}).seqs == []  # both in flight: nothing to run
    for batch in (first, second):
        sched.update(batch)
        batch.seqs[0].append_token(7)
    # the newest sequence is in flight, so the oldest cannot take its blocks: the oldest steps back itself
    blocks_of_new = list(new.block_table)
    assert sched.schedule(busy={new.seq_id}, max_seqs=1).seqs == []
    assert old.status is SequenceStatus.WAITING and sched.num_preemptions == 1
    assert new.status is SequenceStatus.RUNNING and new.block_table == blocks_of_new
    # once its step is back, the newest sequence decodes (with the blocks the oldest gave back)
    assert sched.schedule(max_seqs=1).seqs == [new]
