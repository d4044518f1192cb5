"""A short soak (``benchmarks/soak.py``): a few hundred random requests under preemption, aborts and a queue.

Nothing crashes, the KV ledger balances after every step and ends all free,
resident memory after the warm-up stays flat, and every request that was not
aborted equals its prompt run alone on an unloaded engine.
"""

from __future__ import annotations

from tests.scripts import load_script


def test_a_short_soak_loses_nothing_and_leaks_nothing(tiny_folder):
    report = load_script("benchmarks/soak.py").run_soak(tiny_folder, num_requests=300, seed=1)
    assert report.mismatches == []
    assert report.preemptions > 20, "the KV budget did not force preemption"
    assert report.aborted >= 10 and report.finished["abort"] >= report.aborted
    assert report.finished.get("error", 0) == 0
    assert report.kv_audits == report.steps and report.kv_blocks_free_at_end == report.kv_blocks_total
    assert report.checked_against_reference == sum(report.finished.values()) - report.finished["abort"]
    assert report.prefix_cache_hit_tokens > 0
    assert report.rss_growth < 0.05, report
