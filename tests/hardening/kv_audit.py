"""The KV-cache ledger check the hardening tests run after every step.

Every block is either free or held by live sequences, never both; a held
block's reference count equals the number of sequences whose block table
names it; free + used == total.
"""

from __future__ import annotations

from collections import Counter
from typing import Any


def assert_kv_conserved(engine: Any) -> None:
    bm, sched = engine.block_manager, engine.scheduler
    holders = Counter(block for seq in [*sched.running, *sched.waiting] for block in seq.block_table)
    free = set(bm._free)
    assert len(free) == bm.num_free_blocks == engine.stats()["kv_blocks_free"]
    assert not free & holders.keys(), f"blocks both free and held: {sorted(free & holders.keys())}"
    assert len(free) + len(holders) == bm.num_blocks, (
        f"{len(free)} free + {len(holders)} used != {bm.num_blocks} total")
    wrong = {b: (bm._ref_counts[b], n) for b, n in holders.items() if bm._ref_counts[b] != n}
    assert not wrong, f"reference counts (counted, held) disagree: {wrong}"
    assert all(bm._ref_counts[b] == 0 for b in free)
    assert all(not seq.block_table for seq in sched.waiting), "a waiting sequence holds blocks"


def assert_drained(engine: Any) -> None:
    """Nothing left: no request, every block free."""
    assert not engine.has_unfinished()
    stats = engine.stats()
    assert stats["num_running"] == stats["num_waiting"] == 0
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"], stats
    assert not engine._requests
