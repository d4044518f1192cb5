"""``kunlun-infer generate [prompt=…] [prompts_file=…] [max_tokens=…] … [overrides…]``: stream completions.

All prompts run together in one engine (continuous batching); their texts
are printed in prompt order, each streamed to stdout as it is produced
while the later ones are buffered until their turn. Without a prompt, a
default one is used. ``--json`` prints one JSON object per prompt at the end
instead (text, token ids, finish reason, timings).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from kunlun_infer.commands.base import Command, Flag, Invocation, Param, UsageError
from kunlun_infer.engine.engine import LLMEngine
from kunlun_infer.engine.parallel.placement import local_rank, resolve_parallel_config
from kunlun_infer.engine.parallel.worker import serve_torchrun_worker
from kunlun_infer.engine.params import SamplingParams
from kunlun_infer.runtime import Runtime

DEFAULT_PROMPT = "def fibonacci(n):"


def _bool(value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError("expected true or false")


def read_prompts(inv: Invocation) -> list[str]:
    """Prompts from ``prompt=`` (repeatable) and ``prompts_file=`` (one per line, ``-`` = stdin)."""
    prompts = list(inv.params["prompt"])
    path = inv.params["prompts_file"]
    if path is not None:
        try:
            text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise UsageError(f"prompts_file={path}: cannot read it ({exc.strerror or exc})") from None
        prompts += [line for line in text.splitlines() if line.strip()]
        if not prompts:
            raise UsageError(f"prompts_file={path} holds no prompt (one prompt per non-empty line)")
    return prompts or [DEFAULT_PROMPT]


def sampling_params(inv: Invocation) -> Any:
    p = inv.params
    return SamplingParams(max_tokens=p["max_tokens"], temperature=p["temperature"], top_k=p["top_k"],
                          top_p=p["top_p"], seed=p["seed"], ignore_eos=p["ignore_eos"], stop=tuple(p["stop"]))


class OrderedStream:
    """Writes each request's text in request order, streaming the current one and buffering the rest."""

    def __init__(self, out: Any, request_ids: list[str], prompts: list[str]) -> None:
        self.out = out
        self.order = request_ids
        self.prompts = dict(zip(request_ids, prompts))
        self.pending = {r: "" for r in request_ids}
        self.done: set[str] = set()
        self.current = 0
        self._open(0)

    def _open(self, index: int) -> None:
        if index >= len(self.order):
            return
        if len(self.order) > 1:
            self.out.write(f"--- prompt {index + 1}/{len(self.order)} ---\n")
        self.out.write(self.prompts[self.order[index]])
        self.out.flush()

    def feed(self, request_id: str, delta: str, finished: bool) -> None:
        self.pending[request_id] += delta
        if finished:
            self.done.add(request_id)
        while self.current < len(self.order):
            head = self.order[self.current]
            if self.pending[head]:
                self.out.write(self.pending[head])
                self.pending[head] = ""
                self.out.flush()
            if head not in self.done:
                return
            self.out.write("\n")
            self.current += 1
            self._open(self.current)


def run(inv: Invocation) -> int:
    if serve_torchrun_worker(inv.config()):  # under torchrun, ranks above 0 serve rank 0's engine
        return 0
    prompts = read_prompts(inv)
    params = sampling_params(inv)
    cfg = resolve_parallel_config(inv.config())
    runtime = Runtime.from_config(cfg, plugin_manager=inv.plugin_manager(), local_rank=local_rank())
    try:
        engine = LLMEngine(cfg, runtime=runtime)
        try:
            ids = [engine.add_request(prompt, params) for prompt in prompts]
            finals = _drive(engine, inv, ids, prompts)
            if inv.flags["json"]:
                for request_id in ids:
                    inv.print(json.dumps(_as_json(finals[request_id]), ensure_ascii=False))
            if inv.flags["stats"]:
                print(json.dumps(engine.stats()), file=inv.stderr)
        finally:
            engine.close()
    finally:
        runtime.close()
    return 0


def _drive(engine: Any, inv: Invocation, ids: list[str], prompts: list[str]) -> dict[str, Any]:
    stream = None if inv.flags["json"] else OrderedStream(inv.stdout, ids, prompts)
    finals: dict[str, Any] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if stream is not None:
                stream.feed(out.request_id, out.delta_text, out.finished)
            if out.finished:
                finals[out.request_id] = out
    return finals


def _as_json(out: Any) -> dict[str, Any]:
    m = out.metrics
    return {"request_id": out.request_id, "prompt": out.prompt, "text": out.text, "token_ids": out.token_ids,
            "finish_reason": out.finish_reason, "num_prompt_tokens": len(out.prompt_token_ids),
            "time_to_first_token_s": m.time_to_first_token, "time_per_output_token_s": m.time_per_output_token}


COMMAND = Command(
    name="generate",
    summary="Generate text for one or more prompts, streaming it to stdout as it is produced.",
    run=run,
    params=(
        Param("prompt", f"a prompt (repeatable); default {DEFAULT_PROMPT!r} when no prompt is given",
              multiple=True),
        Param("prompts_file", "a text file with one prompt per line ('-' reads stdin)"),
        Param("max_tokens", "most tokens to generate per prompt", type=int, default=64),
        Param("temperature", "sampling temperature; 0 = greedy (the default)", type=float, default=0.0),
        Param("top_k", "sample among the k most likely tokens; 0 = off", type=int, default=0),
        Param("top_p", "sample from the smallest set of tokens with this much probability; 1 = off",
              type=float, default=1.0),
        Param("seed", "random seed for sampling (same seed, same text)", type=int),
        Param("stop", "a string that ends generation (repeatable); it is not printed", multiple=True),
        Param("ignore_eos", "true = keep generating past the end-of-sequence token", type=_bool, default=False),
    ),
    flags=(
        Flag("json", "print one JSON object per prompt at the end instead of streaming text"),
        Flag("stats", "print the engine's stats() as JSON on stderr at the end"),
    ),
    description="Examples:\n  kunlun-infer generate prompt='def add(a, b):' max_tokens=32\n"
                "  kunlun-infer generate prompts_file=prompts.txt temperature=0.8 seed=1 scheduler=throughput\n"
                "  kunlun-infer generate model.path=/models/qwen3 prompt='Hello' --json",
)
