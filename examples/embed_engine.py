"""Embedding kunlun_infer in an application: a batch of prompts, then an online streaming loop.

Run it as-is (the embedded default model on the CPU plugins) or with Hydra
overrides, e.g.::

    python examples/embed_engine.py
    python examples/embed_engine.py model.path=/path/to/hf_model scheduler.max_num_seqs=8

Part 1 generates for a batch of prompts at once. Part 2 drives the engine
step by step: it streams text as it is produced, adds a request while others
are running (it joins the batch at the next step) and aborts one midway.
"""

from __future__ import annotations

import sys

import kunlun_infer as ki


def batch_generation(llm: ki.LLM) -> None:
    prompts = ["def fibonacci(n):", "import os\n", "class Point:"]
    outputs = llm.generate(prompts, ki.SamplingParams(max_tokens=24, temperature=0.0), use_tqdm=False)
    for out in outputs:
        ttft = out.metrics.time_to_first_token or 0.0
        print(f"{out.prompt!r} -> {out.text!r}  [{len(out.token_ids)} tokens, {out.finish_reason}, "
              f"first token after {ttft * 1000:.1f} ms]")


def online_loop(llm: ki.LLM) -> None:
    engine = llm.engine
    params = ki.SamplingParams(max_tokens=32, temperature=0.8, top_p=0.95, seed=7)
    texts: dict[str, str] = {}
    engine.add_request("def quicksort(items):", params, request_id="quicksort")
    # this one would run to max_tokens (EOS ignored) unless the application aborts it
    engine.add_request("class Stack:", ki.SamplingParams(max_tokens=64, temperature=0.8, seed=8, ignore_eos=True),
                       request_id="stack")
    step = 0
    while engine.has_unfinished():
        for out in engine.step():
            texts[out.request_id] = texts.get(out.request_id, "") + out.delta_text
            if out.delta_text:
                print(f"[{out.request_id}] +{out.delta_text!r}")
            if out.finished:
                print(f"[{out.request_id}] finished ({out.finish_reason}) after {len(out.token_ids)} tokens")
        step += 1
        if step == 3:  # a new request joins the running batch
            engine.add_request("for i in range(10):", ki.SamplingParams(max_tokens=16, temperature=0.0),
                               request_id="late")
        if step == 5 and engine.abort("stack"):  # the application changes its mind about one request
            print("[stack] aborted by the application")
    stats = engine.stats()
    print({key: stats[key] for key in ("kv_blocks_total", "kv_blocks_free", "num_preemptions",
                                       "prefix_cache_hit_tokens", "num_generated_tokens")})


def main(overrides: list[str]) -> None:
    with ki.LLM(overrides=overrides) as llm:
        print("== batch generation ==")
        batch_generation(llm)
        print("== online loop: streaming, a late request, an abort ==")
        online_loop(llm)


if __name__ == "__main__":
    main(sys.argv[1:])
