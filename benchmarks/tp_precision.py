"""How much the all-reduce's accumulation dtype matters: low-precision tensor-parallel logits vs a float32 reference.

Builds a random Llama (hidden 256, 4 layers, 8 heads, 4 KV heads; float32
safetensors), computes the last-position logits of a batch of prompts with
one float32 rank (the reference), then with ``parallel.tensor_size`` 2 and 4
in bfloat16 and float16, once with ``comm.accumulate_dtype=float32`` (the
default: partial sums are widened, summed and rounded once) and once with the
model's own dtype (every addition of the reduction rounds). Prints the max
and mean absolute difference to the reference, and between the two settings.

    python benchmarks/tp_precision.py [--prompts 32] [--length 48]

With two ranks both settings round exactly once (``a + b``), so they agree
bit for bit; the difference can only show from three ranks on.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kunlun_infer import LLM, SamplingParams  # noqa: E402
from tests.engine.tiny_models import build_tiny_model  # noqa: E402

MODEL = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, initializer_range=0.05)


def last_logits(folder: Path, prompts: list[list[int]], overrides: list[str]) -> torch.Tensor:
    """Rank 0's float32 logits of each prompt's last position."""
    with LLM(model=str(folder), overrides=overrides) as llm:
        captured: list[torch.Tensor] = []
        compute = llm.engine.runner.compute

        def capture(inputs):
            logits = compute(inputs)
            if logits is not None:
                captured.append(logits.float().clone())
            return logits

        llm.engine.runner.compute = capture
        llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    return torch.cat(captured)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--length", type=int, default=48)
    args = parser.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (args.length,), generator=g).tolist() for _ in range(args.prompts)]
    base = ["model.max_model_len=256", f"scheduler.max_num_seqs={args.prompts}",
            f"scheduler.max_num_batched_tokens={args.prompts * args.length}"]
    with tempfile.TemporaryDirectory() as tmp:
        folder = build_tiny_model(Path(tmp) / "model", "llama", **MODEL)
        reference = last_logits(folder, prompts, base + ["model.dtype=float32"])
        print(f"reference: 1 rank, float32; logits std {reference.std():.3f}, "
              f"max |logit| {reference.abs().max():.3f}")
        print(f"{'ranks':>5} {'dtype':>9} {'accumulate':>10} {'max|diff|':>10} {'mean|diff|':>11} "
              f"{'max|fp32acc - lowacc|':>22}")
        for tensor_size in (2, 4):
            for dtype in ("bfloat16", "float16"):
                results = {}
                for accumulate in ("float32", dtype):
                    results[accumulate] = last_logits(folder, prompts, base + [
                        f"model.dtype={dtype}", f"parallel.tensor_size={tensor_size}",
                        f"comm.accumulate_dtype={accumulate}"])
                between = (results["float32"] - results[dtype]).abs().max().item()
                for accumulate, logits in results.items():
                    diff = (logits - reference).abs()
                    print(f"{tensor_size:>5} {dtype:>9} {accumulate:>10} {diff.max().item():>10.5f} "
                          f"{diff.mean().item():>11.6f} {between:>22.5f}")


if __name__ == "__main__":
    main()
