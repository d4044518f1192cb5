"""``model.quantization=int8`` over two ranks: every rank quantizes its own shard, the run stays close to one rank.

Row-parallel weights are split along the reduction, so each rank's int8
scales come from its own half of a row and the results differ from one
rank's in the last digits; the per-token log-probabilities of the prompt stay
as far from the unquantized run as one rank's are.
"""

from __future__ import annotations

import torch

from kunlun_infer import LLM, SamplingParams
from tests.parallel.conftest import overrides

PROMPTS = [[5, 9, 2, 7, 11, 3, 8, 1, 4, 6] * 3, list(range(3, 40))]


def prompt_logprobs(folder, ranks: int, *extra: str) -> torch.Tensor:
    with LLM(model=str(folder), overrides=overrides(ranks) + list(extra)) as llm:
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    return torch.tensor([entry[t] for p, o in zip(PROMPTS, outs) for t, entry in zip(p[1:], o.prompt_logprobs[1:])])


def test_two_ranks_run_an_int8_model_close_to_one_rank(tiny_model):
    folder = tiny_model("llama")
    one = prompt_logprobs(folder, 1, "model.quantization=int8")
    two = prompt_logprobs(folder, 2, "model.quantization=int8")
    full = prompt_logprobs(folder, 1)
    one_error, two_error = (one - full).abs().mean(), (two - full).abs().mean()
    assert one_error > 0  # quantized for real
    # each rank's own scales: an error of the same size as one rank's, not a different model
    assert two_error < 2 * one_error and (two - one).abs().mean() < 2 * one_error, (one_error, two_error)
