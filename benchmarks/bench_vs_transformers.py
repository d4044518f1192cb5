"""Throughput of one workload on kunlun_infer and on transformers' ``generate``, in one run.

Both engines get the same random prompts (fixed seed) and produce exactly
``--max-tokens`` new tokens per prompt (EOS ignored), greedy. kunlun_infer
takes all prompts at once with continuous batching; transformers runs them
as one left-padded batch with its KV cache. Prints generated tokens per
second for both and their ratio. Example::

    python benchmarks/bench_vs_transformers.py --model /path/to/hf_model --num-prompts 16
"""

from __future__ import annotations

import argparse
import time

import torch


def make_prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (num, length), generator=g).tolist()


def run_kunlun(model: str | None, prompts: list[list[int]], max_tokens: int, overrides: list[str]) -> float:
    import kunlun_infer as ki

    params = ki.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    with ki.LLM(model=model, overrides=overrides) as llm:
        llm.generate(prompts[:2], ki.SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)  # warm-up
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
    generated = sum(len(o.token_ids) for o in outputs)
    assert generated == len(prompts) * max_tokens, generated
    return generated / elapsed


def run_transformers(folder: str, prompts: list[list[int]], max_tokens: int, dtype: torch.dtype) -> float:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    pad = 0
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    kwargs = dict(do_sample=False, max_new_tokens=max_tokens, min_new_tokens=max_tokens, pad_token_id=pad)
    with torch.inference_mode():
        model.generate(ids[:2, :8], attention_mask=mask[:2, :8], **{**kwargs, "max_new_tokens": 4,
                                                                      "min_new_tokens": 4})  # warm-up
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, **kwargs)
        elapsed = time.perf_counter() - start
    generated = (out.shape[1] - width) * len(prompts)
    assert generated == len(prompts) * max_tokens, generated
    return generated / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="Hugging Face model folder (default: the embedded model)")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("overrides", nargs="*", help="kunlun_infer Hydra overrides (model.dtype=float32 …)")
    args = parser.parse_args()

    from kunlun_infer.engine.startup import DTYPES, model_dir
    from kunlun_infer.models import load_model_config

    folder = model_dir(args.model)
    arch = load_model_config(folder)
    dtype_name = next((o.split("=", 1)[1] for o in args.overrides if o.startswith("model.dtype=")), "float32")
    overrides = [o for o in args.overrides if not o.startswith("model.dtype=")] + [f"model.dtype={dtype_name}"]
    prompts = make_prompts(args.num_prompts, args.prompt_len, arch.vocab_size, args.seed)
    print(f"model {folder} ({arch.architecture}, {dtype_name}); {args.num_prompts} prompts x "
          f"{args.prompt_len} tokens, {args.max_tokens} new tokens each; torch threads {torch.get_num_threads()}")
    ours = run_kunlun(str(folder), prompts, args.max_tokens, overrides)
    print(f"kunlun_infer : {ours:9.1f} generated tokens/s")
    theirs = run_transformers(str(folder), prompts, args.max_tokens, DTYPES[dtype_name])
    print(f"transformers : {theirs:9.1f} generated tokens/s")
    print(f"ratio        : {ours / theirs:9.2f}x (kunlun_infer / transformers)")


if __name__ == "__main__":
    main()
