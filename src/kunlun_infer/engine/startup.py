"""Start-up decisions the engine makes from the config: model folder, dtype, length, KV size.

Each function answers one question and names the config key at fault when
the answer is "no". The KV cache is sized after a warm-up step: the step's
activations are measured where the device reports them (free memory drops
and stays down with a caching allocator) and estimated from the model's
shapes where it does not, and the larger figure is kept out of the budget.
"""

from __future__ import annotations

import importlib.resources
import logging
from pathlib import Path
from typing import Any

import torch

from kunlun_infer.capabilities import Device
from kunlun_infer.engine.params import SamplingParams
from kunlun_infer.engine.scheduler import ScheduledBatch
from kunlun_infer.dtypes import DTYPES
from kunlun_infer.engine.sequence import Sequence
from kunlun_infer.errors import ConfigError, ModelLoadError
from kunlun_infer.models import load_tokenizer

log = logging.getLogger("kunlun_infer.framework")

def default_model_dir() -> Path:
    """The model shipped inside the package."""
    return Path(str(importlib.resources.files("kunlun_infer").joinpath("default_model")))


def model_dir(path: str | None) -> Path:
    """The model folder ``model.path`` names, or the embedded default model when it is ``None``."""
    folder = default_model_dir() if path is None else Path(path).expanduser()
    if not (folder / "config.json").is_file():
        what = "the embedded default model" if path is None else f"model.path={path}"
        raise ModelLoadError(f"{what}: no config.json in {folder}; point model.path at a Hugging Face "
                             f"model folder (config.json, *.safetensors, tokenizer.json)")
    return folder


def model_tokenizer(tokenizer: str | None, folder: Path) -> Any:
    """The tokenizer of ``model.tokenizer``, else of the model ``folder``; ``None`` when the folder has none."""
    if tokenizer is None and not (folder / "tokenizer.json").is_file():
        log.warning("%s has no tokenizer.json: prompts must be token ids and outputs carry no text", folder)
        return None
    return load_tokenizer(tokenizer or folder)


def choose_dtype(requested: str, checkpoint_dtype: Any, device: Device) -> torch.dtype:
    """``model.dtype``: an explicit dtype the device supports, or ``auto`` = the checkpoint's if supported.

    ``requested`` is in range (:func:`kunlun_infer.config.check_ranges`).
    """
    supported = device.supported_dtypes()
    names = ", ".join(sorted(n for n, d in DTYPES.items() if d in supported))
    if requested == "auto":
        dtype = checkpoint_dtype if checkpoint_dtype in DTYPES.values() else torch.float32
        return dtype if dtype in supported else torch.float32
    if DTYPES[requested] not in supported:
        raise ConfigError(f"model.dtype={requested} is not supported by device '{device.name}'; "
                          f"supported: {names}")
    return DTYPES[requested]


def choose_max_model_len(requested: int | None, max_context_len: int) -> int:
    """``model.max_model_len``, at most the context the model serves (default: all of it)."""
    if requested is None:
        return max_context_len
    if not 1 <= requested <= max_context_len:
        raise ConfigError(f"model.max_model_len={requested} must be in [1, {max_context_len}] "
                          f"(the longest context this model serves)")
    return requested


def estimate_activation_bytes(arch: Any, dtype: torch.dtype, num_tokens: int, num_seqs: int) -> int:
    """A generous estimate of one step's activation peak from the model's shapes."""
    element = torch.empty((), dtype=dtype).element_size()
    heads = arch.num_attention_heads + 2 * arch.num_key_value_heads
    per_token = (6 * arch.hidden_size + 3 * arch.intermediate_size + 2 * heads * arch.head_dim) * element
    moe = getattr(arch, "moe", None)
    if moe is not None:  # each token's rows for its experts (gathered, gate/up, activation, output), router scores
        per_token += moe.top_k * (2 * arch.hidden_size + 3 * moe.intermediate_size) * element + 8 * moe.num_experts
    attention_scores = 3 * arch.num_attention_heads * num_tokens * num_tokens * 4  # float32 scores, probs
    logits = 4 * num_seqs * arch.vocab_size * 4  # logits, probabilities, sort, logprobs
    return num_tokens * per_token + attention_scores + logits


def measure_activation_bytes(runner: Any, device: Device, arch: Any, dtype: torch.dtype, *, num_tokens: int,
                             num_seqs: int) -> int:
    """Run :func:`warm_up` and return its activation peak: the drop in free device memory the step
    leaves behind, or the estimate from the model's shapes when that is larger (or not reported)."""
    free_before = device.mem_get_info()[0]
    warm_up(runner, num_tokens=num_tokens, num_seqs=num_seqs)
    measured = max(0, free_before - device.mem_get_info()[0])
    return max(measured, estimate_activation_bytes(arch, dtype, num_tokens, num_seqs))


def warm_up(runner: Any, *, num_tokens: int, num_seqs: int) -> None:
    """Run one full-size step (a long prompt and short ones, all sampled) on a scratch KV cache.

    The runner must hold no cache yet: the scratch one is allocated (on every
    rank, for a tensor-parallel runner) and freed again.
    """
    num_seqs = max(1, min(num_seqs, num_tokens))
    lengths = [num_tokens - (num_seqs - 1)] + [1] * (num_seqs - 1)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    seqs, next_block = [], 0
    for i, n in enumerate(lengths):
        seq = Sequence(-1 - i, f"warm-up-{i}", [0] * n, params)
        blocks = -(-n // runner.block_size)
        seq.block_table = list(range(next_block, next_block + blocks))
        next_block += blocks
        seqs.append(seq)
    runner.resize_kv_cache(next_block)
    try:
        runner.execute(ScheduledBatch(seqs, lengths, num_prefill_tokens=num_tokens))
    finally:
        runner.resize_kv_cache(0)
