"""What a benchmark sends: a seeded synthetic workload, or prompts from a JSONL file.

Lengths are written ``N`` (every request the same) or ``LOW:HIGH`` (uniform
integers, both ends included). Synthetic prompts are random token ids of the
model's vocabulary; every request ignores EOS, so it produces exactly its
output length and runs are comparable. A JSONL line is
``{"prompt": "text"}`` or ``{"prompt_token_ids": [...]}``, optionally with
``"max_tokens"``; lines without it draw an output length.
"""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

from kunlun_infer.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class LengthRange:
    """A length distribution: uniform integers in ``[low, high]``."""

    low: int
    high: int

    @classmethod
    def parse(cls, text: str | int, *, what: str = "length") -> LengthRange:
        """``"128"`` or ``"64:256"``."""
        raw = str(text).strip()
        low_text, sep, high_text = raw.partition(":")
        try:
            low = int(low_text)
            high = int(high_text) if sep else low
        except ValueError:
            raise ConfigError(f"{what}={raw!r}: write a length (128) or a range LOW:HIGH (64:256)") from None
        if not 1 <= low <= high:
            raise ConfigError(f"{what}={raw!r}: lengths must be >= 1 and LOW <= HIGH")
        return cls(low, high)

    def draw(self, rng: random.Random) -> int:
        return rng.randint(self.low, self.high)

    def __str__(self) -> str:
        return str(self.low) if self.low == self.high else f"{self.low}:{self.high}"


@dataclasses.dataclass(frozen=True)
class BenchRequest:
    """One request: a prompt (text or token ids) and exactly how many tokens to generate."""

    prompt: str | list[int]
    max_tokens: int


@dataclasses.dataclass(frozen=True)
class Workload:
    """The requests of a benchmark and a one-line description of where they came from."""

    requests: tuple[BenchRequest, ...]
    description: str


def synthetic_workload(num_prompts: int, input_len: LengthRange, output_len: LengthRange, *, vocab_size: int,
                       seed: int = 0) -> Workload:
    """``num_prompts`` random-token prompts; the same arguments always give the same workload."""
    if num_prompts < 1:
        raise ConfigError(f"num_prompts={num_prompts} must be >= 1")
    rng = random.Random(seed)
    requests = []
    for _ in range(num_prompts):
        n = input_len.draw(rng)
        requests.append(BenchRequest([rng.randrange(vocab_size) for _ in range(n)], output_len.draw(rng)))
    return Workload(tuple(requests), f"synthetic: {num_prompts} prompts, input {input_len}, output {output_len}, "
                                     f"seed {seed}")


def jsonl_workload(path: str | Path, output_len: LengthRange, *, seed: int = 0,
                   num_prompts: int | None = None) -> Workload:
    """Prompts from a JSONL file (the first ``num_prompts`` when given)."""
    rng = random.Random(seed)
    requests = []
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ConfigError(f"prompts_file={path}: cannot read it ({exc.strerror or exc})") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            prompt = item["prompt_token_ids"] if "prompt_token_ids" in item else item["prompt"]
            max_tokens = int(item.get("max_tokens", 0)) or output_len.draw(rng)
        except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError):
            raise ConfigError(f"prompts_file={path}, line {number}: expected a JSON object with 'prompt' (text) "
                              f"or 'prompt_token_ids' (list of ints), optionally 'max_tokens'") from None
        requests.append(BenchRequest(prompt if isinstance(prompt, str) else [int(t) for t in prompt], max_tokens))
        if num_prompts is not None and len(requests) >= num_prompts:
            break
    if not requests:
        raise ConfigError(f"prompts_file={path} holds no prompt")
    return Workload(tuple(requests), f"{path}: {len(requests)} prompts")
