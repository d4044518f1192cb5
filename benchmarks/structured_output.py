"""What a structured-output mask costs a decode step: batch 32 on the ~11M-parameter model.

The model is workload B of ``perf_cpu.py`` (Llama-shaped, hidden 256, 4
layers, 8 heads, 2 KV heads, intermediate 768, vocab 32000, random
weights); its 32000-token byte-level BPE tokenizer is trained here on the
Python standard library's sources, so the grammar backend sees a real
vocabulary of that size. In one run:

- ``free``: 32 requests without constraint (sampled, EOS ignored);
- ``json``: the same 32 requests, each constrained by a JSON schema.

For every decode step where all 32 sequences run, the step's time is
recorded, and in ``json`` also the time spent in the structured-output mask
(bringing the 32 grammar states up to date, filling the bitmask, applying
it). Times are the process's CPU time (all its threads), which other
programs on a shared machine disturb far less than wall time; wall times are
reported beside them. Reported: median step times, the mask's median time
per step, and the mask as a fraction of the unconstrained step. Prints a table and writes
``benchmarks/results/structured_output.json``::

    python benchmarks/structured_output.py
    KUNLUN_INFER_CPU_ISA=avx2 python benchmarks/structured_output.py --tag avx2   # an AVX2-only CPU's kernels
    CC=none python benchmarks/structured_output.py --tag torch    # no native kernels: the torch reference mask
"""

from __future__ import annotations

import argparse
import json
import statistics
import sysconfig
import tempfile
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import machine  # noqa: E402  (a sibling file: what every benchmark records of the machine)

RESULTS = Path(__file__).resolve().parent / "results" / "structured_output.json"
BATCH = 32
SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string"},
    "year": {"type": "integer"},
    "tags": {"type": "array", "items": {"enum": ["new", "used", "rare", "signed"]}},
    "owner": {"type": "object", "properties": {"name": {"type": "string"}, "city": {"type": "string"}},
              "required": ["name", "city"]},
    "notes": {"type": "array", "items": {"type": "string"}},
}, "required": ["title", "year", "tags", "owner", "notes"]}


def build_tokenizer(folder: Path, vocab_size: int, max_bytes: int) -> None:
    """A byte-level BPE of ``vocab_size`` tokens trained on the standard library (first ``max_bytes``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts, total = [], 0
    for path in sorted(stdlib.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="ignore")
        texts.append(text)
        total += len(text)
        if total >= max_bytes:
            break
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))


def build_model(folder: Path) -> int:
    import transformers as tf

    config = tf.LlamaConfig(vocab_size=32000, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                            num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048,
                            tie_word_embeddings=True, eos_token_id=0, bos_token_id=None)
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(config)
    model.save_pretrained(folder, safe_serialization=True)
    return sum(p.numel() for p in model.parameters())


def clock() -> tuple[float, float]:
    return time.process_time(), time.perf_counter()


def since(start: tuple[float, float]) -> tuple[float, float]:
    cpu, wall = clock()
    return cpu - start[0], wall - start[1]


def run(engine: Any, prompts: list[list[int]], params: list[Any],
        timed_mask: list[tuple[float, float]] | None) -> list[tuple[float, float]]:
    """Step ``engine`` over the requests; (CPU, wall) seconds of each step where all of them decode."""
    for prompt, p in zip(prompts, params):
        engine.add_request(prompt, p)
    steps = []
    while engine.has_unfinished():
        before = len(timed_mask) if timed_mask is not None else 0
        start = clock()
        engine.step()
        took = since(start)
        full = engine.stats()["num_running"] == BATCH and engine.scheduler.running[0].num_generated_tokens > 1
        if full:
            steps.append(took)
        elif timed_mask is not None:
            del timed_mask[before:]  # keep mask times of full decode steps only
    return steps


def median_ms(times: list[tuple[float, float]], which: int) -> float:
    return statistics.median(t[which] for t in times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=96, help="tokens generated per request")
    parser.add_argument("--corpus-bytes", type=int, default=6_000_000, help="tokenizer training text")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--tag", default="default", help="name of this run in the results file")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    import kunlun_infer as ki

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        build_tokenizer(folder, 32000, args.corpus_bytes)
        params_count = build_model(folder)
        overrides = [f"model.path={folder}", f"scheduler.max_num_seqs={BATCH}", "cache.prefix_caching=false",
                     "cache.num_blocks=1024", "model.max_model_len=1024"]
        with ki.LLM(overrides=overrides) as llm:
            engine = llm.engine
            prompts = [engine.tokenizer.encode(f"record {i}: ") for i in range(BATCH)]
            free = [ki.SamplingParams(max_tokens=args.tokens, temperature=1.0, seed=i, ignore_eos=True)
                    for i in range(BATCH)]
            constrained = [ki.SamplingParams(max_tokens=args.tokens, temperature=1.0, seed=i,
                                             structured={"json": SCHEMA}) for i in range(BATCH)]
            run(engine, prompts[:2], constrained[:2], None)  # warm-up: imports, grammar compile, kernels
            mask_times: list[tuple[float, float]] = []
            apply = engine.structured.apply

            def timed_apply(logits: torch.Tensor, targets: Any) -> bool:
                start = clock()
                try:
                    return apply(logits, targets)
                finally:
                    mask_times.append(since(start))

            engine.structured.apply = timed_apply
            free_steps, json_steps = [], []
            for _ in range(2):  # interleaved, so drifting machine load hits both alike
                free_steps += run(engine, prompts, free, None)
                json_steps += run(engine, prompts, constrained, mask_times)
    if not json_steps or not mask_times:
        raise SystemExit("no decode step ran all 32 constrained sequences at once; raise --tokens")
    free_ms, json_ms, mask_ms = (median_ms(t, 0) for t in (free_steps, json_steps, mask_times))
    wall = {name: round(median_ms(t, 1), 3) for name, t in
            (("free_step_ms", free_steps), ("json_step_ms", json_steps), ("mask_ms_per_step", mask_times))}
    result = {"machine": machine.facts(), "model_parameters": params_count, "vocab": 32000, "batch": BATCH,
              "free_step_ms": round(free_ms, 3), "json_step_ms": round(json_ms, 3),
              "mask_ms_per_step": round(mask_ms, 3), "mask_fraction_of_free_step": round(mask_ms / free_ms, 4),
              "json_step_over_free_step": round(json_ms / free_ms, 4), "wall_clock": wall,
              "steps_measured": {"free": len(free_steps), "json": len(json_steps)}}
    mask_kernel = f"native {result['machine']['kernel_set']} (masked stores)" \
        if result["machine"]["kernel_set"] != "torch" else "reference (torch)"
    result["mask_kernel"] = mask_kernel
    print(f"CPU: {machine.describe(result['machine'])}; mask kernel: {mask_kernel}")
    print(f"decode step, batch {BATCH}, {params_count / 1e6:.1f}M params, vocab 32000 (CPU ms; wall ms):")
    print(f"  free                    {free_ms:8.2f}  {wall['free_step_ms']:8.2f}")
    print(f"  json schema             {json_ms:8.2f}  {wall['json_step_ms']:8.2f}  ({json_ms / free_ms:.2f}x)")
    print(f"  mask (sync+fill+apply)  {mask_ms:8.2f}  {wall['mask_ms_per_step']:8.2f}  "
          f"({100 * mask_ms / free_ms:.1f}% of a free step)")
    RESULTS.parent.mkdir(exist_ok=True)
    saved = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    saved[args.tag] = result
    RESULTS.write_text(json.dumps(saved, indent=2) + "\n")


if __name__ == "__main__":
    main()
