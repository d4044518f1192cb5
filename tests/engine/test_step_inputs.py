"""A step's flat batch: a decode step's inputs, built from plain lists, equal those the general builder makes.

Most steps are decodes (every sequence computes its last token and samples
the next), so ``build_step_inputs`` builds them without the per-token tensor
work prompt chunks need; the model must get the very same inputs either way.
"""

from __future__ import annotations

import random

import torch

from kunlun_infer.engine import model_runner
from kunlun_infer.engine.params import SamplingParams
from kunlun_infer.engine.sequence import Sequence
from kunlun_infer.ops.attention_step import decodes_first


def decoding(count: int, seed: int, block_size: int = 16) -> list[Sequence]:
    """``count`` sequences, each with its last token uncomputed, over shuffled cache blocks."""
    rng = random.Random(seed)
    blocks = list(range(count * 70))
    rng.shuffle(blocks)
    seqs = []
    for i in range(count):
        prompt, generated = rng.randint(1, 600), rng.randint(0, 300)
        seq = Sequence(i, f"r{i}", [rng.randrange(1000) for _ in range(prompt)], SamplingParams())
        seq.token_ids += [rng.randrange(1000) for _ in range(generated)]
        seq.num_computed_tokens = len(seq) - 1
        seq.block_table = [blocks.pop() for _ in range(-(-len(seq) // block_size))]
        seqs.append(seq)
    return seqs


def flat(inputs) -> dict:
    return {"input_ids": inputs.input_ids.tolist(), "positions": inputs.positions.tolist(),
            "logits_indices": inputs.logits_indices.tolist(), "sample_rows": inputs.sample_rows,
            "prompt_spans": inputs.prompt_spans, "draft_rows": inputs.draft_rows, "order": inputs.order,
            **{f: getattr(inputs.attn, f) for f in ("query_lens", "context_lens", "block_tables", "slot_mapping")},
            "dtypes": (inputs.input_ids.dtype, inputs.positions.dtype, inputs.logits_indices.dtype)}


def test_a_decode_step_gets_the_general_builders_inputs():
    for seed, count in [(0, 1), (1, 7), (2, 64)]:
        seqs = decoding(count, seed)
        order = list(range(count))
        random.Random(seed).shuffle(order)  # a backend's own order of the rows
        for rows in (None, order):
            got = model_runner.build_step_inputs(seqs, [1] * count, 16, torch.device("cpu"), rows)
            want = model_runner._flat_inputs(seqs, [1] * count, 16, torch.device("cpu"),
                                             list(range(count)) if rows is None else rows, None)
            assert flat(got) == flat(want)
            assert got.input_ids.tolist() == [seqs[i].token_ids[-1] for i in got.order]


def test_a_step_with_a_prompt_chunk_takes_the_general_builder(monkeypatch):
    seqs = decoding(4, 3)
    seqs[2].num_computed_tokens -= 5  # its last six tokens: a chunk, not a decode
    counts = [1, 1, 6, 1]
    order = decodes_first(counts)

    def refuse(*args):
        raise AssertionError("a step with a chunk went the decode way")

    monkeypatch.setattr(model_runner, "_decode_inputs", refuse)
    inputs = model_runner.build_step_inputs(seqs, counts, 16, torch.device("cpu"), order)
    assert inputs.attn.query_lens == [1, 1, 1, 6] and len(inputs.attn.slot_mapping) == 9
