"""The sampler's cost per step on the host CPU, against transformers' sampling on the same logits.

A decode step of a sampled (temperature > 0) request ends with turning a
row of logits over the whole vocabulary into a token. This times the
engine's ``Sampler.draw`` (temperature, top-k/top-p, min_p, the draw) for
``--batches`` rows of a ``--vocab``-wide vocabulary (Qwen2's 151936 by
default), in the parameter sets chat clients send, beside what
transformers' ``generate(do_sample=True)`` does per step on the same logits
(its temperature / top-k / top-p / min-p warpers, softmax and
``torch.multinomial``), in turns; with ``--before REV`` also the engine's
sampler as it was at a git revision. Rows are Zipf-like (a likelihood
falling as rank^-s, s drawn per row in [1.0, 1.6], in shuffled order), so
top-p's nucleus ranges from tens to thousands of tokens, as a language
model's does (``--logits normal``: wide normal rows, whose nucleus holds
thousands). Rows with penalties start from ``--history`` tokens (a prompt
and an output so far) and gain their drawn token each step, as a decoding
sequence does. Medians in milliseconds, with the CPU model and ISA.

``--served``: also the useful tokens per second of ``perf_cpu.py``'s 8
requests on its random-weight Qwen2-shaped 0.5B model (bf16), greedy and
sampled, the best of two servings each (a random model's distributions are
nearly flat: top-p's nucleus there holds most of the vocabulary)::

    python benchmarks/sampling.py
    python benchmarks/sampling.py --batches 1,8,32,128 --before HEAD~1
    python benchmarks/sampling.py --batches 8,32 --history 3000,1000 --before HEAD~1
    python benchmarks/sampling.py --batches 32,128 --logits normal --before HEAD~1
    python benchmarks/sampling.py --served
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import machine  # noqa: E402  (a sibling file: what every benchmark records of the machine)

REPO = Path(__file__).resolve().parent.parent
#: name -> SamplingParams keywords: what chat clients commonly send
CASES = {
    # greedy decoding: transformers' generate() takes argmax; the engine the op table's greedy_tokens, as its cpu
    # ops answer it (hook API 1.8); sampled rows its sample_tokens (1.10)
    "greedy": {"temperature": 0.0},
    "temperature 0.7": {"temperature": 0.7},
    "temperature 0.2": {"temperature": 0.2},  # code and agents: most of a row far below its top token
    "top_p 0.9": {"temperature": 0.7, "top_p": 0.9},
    "top_k 50": {"temperature": 0.7, "top_k": 50},
    "top_k 20, top_p 0.8": {"temperature": 0.7, "top_k": 20, "top_p": 0.8},
    "min_p 0.05": {"temperature": 1.0, "min_p": 0.05},
    "seeded": {"temperature": 0.7, "seed": 1},
    # Qwen2.5's generation_config.json: what its chat users get by default
    "Qwen2.5 defaults": {"temperature": 0.7, "top_k": 20, "top_p": 0.8, "repetition_penalty": 1.05},
}
#: the tokens each row has seen, where a case asks for penalties: a prompt and the output so far (``--history``)
HISTORY = (512, 128)


class History:
    """A row's sequence as the sampler reads it; each step's drawn token is appended, as the engine does."""

    def __init__(self, token_ids: list[int], num_prompt_tokens: int) -> None:
        self.token_ids, self.num_prompt_tokens = token_ids, num_prompt_tokens
        self.stop_token_ids: frozenset[int] = frozenset()
        self.constraint = None


def zipf_logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    log_rank = torch.arange(1, vocab + 1, dtype=torch.float32).log()
    slopes = 1.0 + 0.6 * torch.rand(rows, generator=g)
    out = torch.stack([(-s * log_rank)[torch.randperm(vocab, generator=g)] for s in slopes.tolist()])
    return out + 0.05 * torch.randn(rows, vocab, generator=g)


def normal_logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """Wide rows (normal, sigma 2.5): no token far ahead, so top-p's nucleus holds thousands of tokens."""
    return 2.5 * torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed))


#: ``--logits``: how a step's rows are made
LOGITS = {"zipf": zipf_logits, "normal": normal_logits}


def transformers_step(kwargs: dict[str, Any], history: tuple[int, int]) -> Callable[[torch.Tensor], torch.Tensor]:
    """What ``generate(do_sample=True)`` runs on a step's logits with these settings (its ``input_ids`` growing
    by the drawn tokens)."""
    import transformers as tf

    if kwargs.get("temperature", 1.0) == 0.0:
        return lambda logits: logits.argmax(dim=-1)
    warpers = tf.LogitsProcessorList()
    if kwargs.get("temperature", 1.0) != 1.0:
        warpers.append(tf.TemperatureLogitsWarper(kwargs["temperature"]))
    if kwargs.get("top_k"):
        warpers.append(tf.TopKLogitsWarper(kwargs["top_k"]))
    if kwargs.get("top_p", 1.0) < 1.0:
        warpers.append(tf.TopPLogitsWarper(kwargs["top_p"]))
    if kwargs.get("min_p"):
        warpers.append(tf.MinPLogitsWarper(kwargs["min_p"]))
    if kwargs.get("repetition_penalty", 1.0) != 1.0:  # generate() applies it before the warpers
        warpers.insert(0, tf.RepetitionPenaltyLogitsProcessor(kwargs["repetition_penalty"]))
    generator = torch.Generator().manual_seed(0)

    seen: dict[tuple[int, int], torch.Tensor] = {}  # the token ids each row has seen (for the penalty)

    def step(logits: torch.Tensor) -> torch.Tensor:
        shape = tuple(logits.shape)
        if shape not in seen:
            g = torch.Generator().manual_seed(shape[0])
            seen[shape] = torch.randint(0, shape[1], (shape[0], sum(history)), generator=g)
        scores = warpers(seen[shape], logits)
        drawn = torch.multinomial(scores.softmax(dim=-1), 1, generator=generator)
        seen[shape] = torch.cat([seen[shape], drawn], dim=1)
        return drawn.squeeze(1)

    return step


def engine_step(sampler_module: Any, kwargs: dict[str, Any], rows: int,
                history: tuple[int, int]) -> Callable[[torch.Tensor], torch.Tensor]:
    from kunlun_infer.engine.params import SamplingParams
    from kunlun_infer.plugins import cpu_kernels

    # the cpu ops' greedy_tokens and sample_tokens, as the engine resolves them; a revision from before
    # sample_tokens (1.10), greedy_tokens (1.8) or the nucleus search (it always sorts) takes what it knows
    for ops in ({"greedy": cpu_kernels.greedy_tokens, "sample": cpu_kernels.sample_tokens},
                {"greedy": cpu_kernels.greedy_tokens}, {}):
        try:
            sampler = sampler_module.Sampler(torch.Generator().manual_seed(0), waits_are_free=True, **ops)
            break
        except TypeError:
            continue
    else:
        sampler = sampler_module.Sampler(torch.Generator().manual_seed(0))
    params = [SamplingParams(**kwargs)] * rows
    generators = [torch.Generator().manual_seed(i) if "seed" in kwargs else None for i in range(rows)]
    if not params[0].has_penalties:
        return lambda logits: sampler.draw(logits, params, generators)[0]
    g = torch.Generator().manual_seed(rows)
    histories = [History(torch.randint(0, 151936, (sum(history),), generator=g).tolist(), history[0])
                 for _ in range(rows)]

    def step(logits: torch.Tensor) -> torch.Tensor:
        drawn = sampler.draw(logits, params, generators, histories)[0]
        for h, token in zip(histories, drawn.tolist()):
            h.token_ids.append(token)
        return drawn

    return step


def sampler_at(rev: str, into: Path) -> Any:
    """The engine's sampler module as it was at git revision ``rev``."""
    source = subprocess.run(["git", "-C", str(REPO), "show", f"{rev}:src/kunlun_infer/engine/sampler.py"],
                            check=True, capture_output=True, text=True).stdout
    path = into / "sampler_before.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("sampler_before", path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules["sampler_before"] = module  # (its dataclasses look their module up)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def in_turns(calls: dict[str, Callable[[torch.Tensor], torch.Tensor]], logits: torch.Tensor,
             turns: int) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in calls}
    for call in calls.values():
        call(logits)  # first calls
    order = list(calls.items())
    for turn in range(turns):  # every other turn in reverse: no call always runs after the same one
        for name, call in (order if turn % 2 == 0 else order[::-1]):
            fresh = logits.clone()  # a step's own logits, written already (the sampler may reshape them in place)
            start = time.perf_counter()
            call(fresh)
            times[name].append(time.perf_counter() - start)
    return {name: 1e3 * statistics.median(values) for name, values in times.items()}


def served(model_dir: Path) -> dict[str, float]:
    """Useful tokens/s of perf_cpu's 8 requests, greedy and with each of ``CASES`` but the seeded one."""
    import perf_cpu

    import kunlun_infer as ki

    shape = perf_cpu.SHAPES["0.5b"]
    folder = perf_cpu.build_model(shape, model_dir / "0.5b")
    requests = perf_cpu.make_requests(8, shape.vocab, seed=0)
    out = {}
    with perf_cpu.open_engine(folder, "bfloat16", []) as llm:
        for case, kwargs in {"greedy": {"temperature": 0.0}, **CASES}.items():
            if "seed" in kwargs:
                continue
            params = [ki.SamplingParams(max_tokens=n, ignore_eos=True, **kwargs) for n in requests.output_lens]
            llm.generate(requests.prompts[:2], params[:2], use_tqdm=False)  # first calls
            best = float("inf")
            for _ in range(2):
                start = time.perf_counter()
                llm.generate(requests.prompts, params, use_tqdm=False)
                best = min(best, time.perf_counter() - start)
            out[case] = requests.useful_tokens / best
            print(f"8 requests, {case:<20} {out[case]:8.1f} tok/s", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--turns", type=int, default=15)
    parser.add_argument("--history", default=",".join(map(str, HISTORY)), metavar="PROMPT,OUTPUT",
                        help="the tokens each penalized row has seen when a case starts (each step adds one)")
    parser.add_argument("--before", default=None, metavar="REV", help="also time the sampler at this git revision")
    parser.add_argument("--served", action="store_true", help="also serve perf_cpu.py's 8 requests, sampled")
    parser.add_argument("--model-dir", type=Path, default=Path(tempfile.gettempdir()) / "kunlun_infer_perf_cpu",
                        help="where --served's model is built (or found)")
    parser.add_argument("--logits", choices=sorted(LOGITS), default="zipf",
                        help="Zipf-like rows (a language model's), or wide normal ones (sigma 2.5)")
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    args = parser.parse_args(argv)
    history = tuple(int(n) for n in args.history.split(","))
    from kunlun_infer.engine import sampler as current

    facts = machine.facts()
    print(machine.describe(facts))
    results: dict[str, Any] = {"machine": facts, "vocab": args.vocab, "logits": args.logits, "history": history,
                               "milliseconds": {}}
    with tempfile.TemporaryDirectory() as tmp:
        before = sampler_at(args.before, Path(tmp)) if args.before else None
        names = ["kunlun_infer", "transformers"] + ([f"at {args.before}"] if before else [])
        print(f"{'rows':>4}  {'parameters':<20}" + "".join(f"{n:>16}" for n in names) + f"{'ratio':>8}")
        for rows in (int(b) for b in args.batches.split(",")):
            logits = LOGITS[args.logits](rows, args.vocab, seed=rows)
            for case, kwargs in CASES.items():
                calls = {"kunlun_infer": engine_step(current, kwargs, rows, history),
                         "transformers": transformers_step(kwargs, history)}
                if before is not None:
                    calls[f"at {args.before}"] = engine_step(before, kwargs, rows, history)
                figures = in_turns(calls, logits, args.turns)
                results["milliseconds"].setdefault(rows, {})[case] = figures
                ratio = figures["transformers"] / figures["kunlun_infer"]
                print(f"{rows:>4}  {case:<20}" + "".join(f"{figures[n]:>16.3f}" for n in names) + f"{ratio:>7.1f}x",
                      flush=True)
    if args.served:
        results["served_tokens_per_s"] = served(args.model_dir)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
