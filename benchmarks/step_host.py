"""The host's share of a decode step: scheduling, inputs, sampling and bookkeeping, with a model too small to matter.

On a GPU a decode step's kernels take well under a millisecond once they
replay from a graph, so the Python around them decides the step time (the
H200 runs of ``perf_gpu.py``: ~9 ms per step at 256 sequences). This
measures that Python on the host CPU: a 2-layer, 64-wide random Llama, so
the forward is a small part of the step, ``batch`` sequences decoding
together (fresh prompts of 128-1024 tokens, prefill steps left out), every
step timed, and each part of it timed alone by wrapping the engine's own
calls: ``schedule`` (the scheduler), ``prepare`` (the step's inputs and
attention metadata), ``compute`` (embedding, layers, head), ``sample`` and
``apply`` (tokens recorded, stop checks, outputs; for an overlapped step,
``scheduler.overlap_steps=on``, the step's scheduling of decodes, its draw
on the device and its landing). Requests report only
when they finish, as ``LLM.generate`` asks (``--outputs every``: an output
for every token, as a streaming server asks). Medians in milliseconds;
prints the CPU model and ISA::

    python benchmarks/step_host.py --batches 1,64,256
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import machine  # noqa: E402  (a sibling file: what every benchmark records of the machine)

PARTS = ("schedule", "prepare", "compute", "sample", "apply")


def tiny_model(folder: Path) -> Path:
    import transformers

    config = transformers.LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                                      bos_token_id=None, eos_token_id=None, tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    return folder


def timed(times: dict[str, list[float]], name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            times[name].append(time.perf_counter() - start)
    return run


def part_calls(engine: Any) -> list[tuple[str, Any, str]]:
    """``(part, owner, method)`` for every engine call a step's part is made of: an overlapped step
    (``scheduler.overlap_steps``) schedules behind the step in flight, draws on the device (``Sampler.draw``)
    and records its tokens in ``_land``."""
    sample = (engine.runner.sampler, "draw") if engine.overlap else (engine.runner, "sample")
    return [("schedule", engine.scheduler, "schedule"), ("schedule", engine, "_schedule_behind"),
            ("prepare", engine.runner, "prepare"), ("compute", engine.runner, "compute"), ("sample", *sample),
            ("apply", engine, "_apply"), ("apply", engine, "_land")]


def measure(folder: Path, batch: int, steps: int, overrides: list[str], final_only: bool = True) -> dict[str, float]:
    import kunlun_infer as ki

    with ki.LLM(model=str(folder), overrides=[
            "model.dtype=float32", f"scheduler.max_num_seqs={batch}", "scheduler.max_num_batched_tokens=8192",
            "model.max_model_len=2048", f"cache.num_blocks={batch * 80 + 64}", "cache.prefix_caching=false",
            f"ops.step_graphs={batch}", *overrides]) as llm:
        engine = llm.engine
        g = torch.Generator().manual_seed(0)
        params = ki.SamplingParams(max_tokens=steps + 50, temperature=0.0, ignore_eos=True)
        for n in torch.randint(128, 1024, (batch,), generator=g).tolist():
            engine.add_request(torch.randint(0, 1000, (n,), generator=g).tolist(), params, final_only=final_only)
        while engine.scheduler.waiting or any(s.num_computed_tokens < len(s) - 1 for s in engine.scheduler.running):
            engine.step()
        for _ in range(5):  # captures and first calls
            engine.step()
        times: dict[str, list[float]] = {name: [] for name in (*PARTS, "step")}
        for part, owner, name in part_calls(engine):
            setattr(owner, name, timed(times, part, getattr(owner, name)))
        for _ in range(steps):
            start = time.perf_counter()
            engine.step()
            times["step"].append(time.perf_counter() - start)
    return {name: 1e3 * statistics.median(values) for name, values in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,64,256")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--outputs", choices=("final", "every"), default="final",
                        help="requests report when they finish (LLM.generate) or at every token (streaming)")
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    facts = machine.facts()
    print(machine.describe(facts))
    results: dict[str, Any] = {"machine": facts, "overrides": args.overrides, "outputs": args.outputs,
                               "milliseconds": {}}
    with tempfile.TemporaryDirectory() as tmp:
        folder = tiny_model(Path(tmp))
        print(f"{'batch':>5} " + " ".join(f"{p:>9}" for p in (*PARTS, "step")))
        for batch in (int(b) for b in args.batches.split(",")):
            figures = measure(folder, batch, args.steps, args.overrides, final_only=args.outputs == "final")
            results["milliseconds"][batch] = figures
            print(f"{batch:>5} " + " ".join(f"{figures[p]:>9.3f}" for p in (*PARTS, "step")), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
