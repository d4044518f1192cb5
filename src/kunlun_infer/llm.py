"""``LLM``: the few-lines way to use the engine — build from a model and overrides, generate.

``LLM(model=None, overrides=None)`` composes the config (``model=None`` is the
embedded default model), starts an :class:`LLMEngine` and keeps it in
``llm.engine`` for online use. :meth:`LLM.generate` runs a whole batch of
prompts to completion with continuous batching and returns their outputs in
prompt order. ``close()`` (or leaving a ``with`` block) releases everything.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from omegaconf import DictConfig, open_dict

from kunlun_infer.chat import encode_prompt, engine_chat_template, is_conversation_list
from kunlun_infer.engine.engine import LLMEngine
from kunlun_infer.engine.outputs import RequestOutput
from kunlun_infer.engine.params import SamplingParams
from kunlun_infer.errors import RequestError
from kunlun_infer.runtime import compose_config

Prompts = str | Sequence[str] | Sequence[Sequence[int]]


class LLM:
    """A model ready to generate. ``with LLM(...) as llm:`` closes it on exit."""

    def __init__(self, model: str | None = None, overrides: Sequence[str] | None = None) -> None:
        cfg = compose_config(list(overrides or ()))
        if model is not None:
            with open_dict(cfg):
                cfg.model.path = str(model)
        self.engine = LLMEngine.from_config(cfg)

    @classmethod
    def from_config(cls, cfg: DictConfig) -> LLM:
        """An ``LLM`` for a config from :func:`kunlun_infer.compose_config`."""
        llm = cls.__new__(cls)
        llm.engine = LLMEngine.from_config(cfg)
        return llm

    @property
    def config(self) -> DictConfig:
        return self.engine.config

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(self, prompts: Prompts, params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt (text, or token-id lists) and return the final outputs in order.

        ``params`` is one :class:`SamplingParams` for all prompts or one per
        prompt. A prompt asking for ``n > 1`` samples gives ``n`` outputs in a
        row (``index`` 0 … n-1). Every request is checked before any is
        queued, so a bad one raises :class:`RequestError` and nothing runs.
        """
        prompt_list = _as_prompt_list(prompts)
        params_list = _as_params_list(params, len(prompt_list))
        requests = [self.engine.prepare_request(prompt, p) for prompt, p in zip(prompt_list, params_list)]
        ids = [self.engine.add_request(request, final_only=True) for request in requests]
        num_samples = {request_id: p.n for request_id, p in zip(ids, params_list)}
        finals: dict[str, list[RequestOutput]] = {request_id: [] for request_id in ids}
        done: set[str] = set()
        progress = _progress(len(ids), use_tqdm)
        try:
            while len(done) < len(ids):
                for output in self.engine.step():
                    samples = finals.get(output.request_id)
                    if output.finished and samples is not None:
                        samples.append(output)
                        if len(samples) == num_samples[output.request_id]:
                            done.add(output.request_id)
                            progress.update(1)
        except BaseException:
            for request_id in finals.keys() - done:
                self.engine.abort(request_id)
            raise
        finally:
            progress.close()
        return [o for request_id in ids for o in sorted(finals[request_id], key=lambda o: o.index)]

    def chat(self, messages: Any, params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, *, chat_template: str | None = None, add_generation_prompt: bool = True,
             tools: Sequence[dict[str, Any]] | None = None, **template_kwargs: Any) -> list[RequestOutput]:
        """Answer one conversation (a list of ``{"role", "content"}`` dicts) or a list of conversations.

        Each is rendered with the model's chat template (``chat_template``
        picks a named one) and generated like :meth:`generate`; outputs come
        in conversation order, with ``prompt`` set to the rendered text.
        """
        conversations = list(messages) if is_conversation_list(messages) else [messages]
        template = engine_chat_template(self.engine, chat_template)
        texts = [template.render(c, add_generation_prompt=add_generation_prompt, tools=tools, **template_kwargs)
                 for c in conversations]
        params_list = _as_params_list(params, len(texts))
        outputs = self.generate([encode_prompt(self.tokenizer, t) for t in texts], params_list, use_tqdm)
        for output, text in zip(outputs, [t for t, p in zip(texts, params_list) for _ in range(p.n)]):
            output.prompt = text
        return outputs

    def close(self) -> None:
        """Release the engine, its KV cache and the runtime (device, memory, comm, streams)."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _as_prompt_list(prompts: Prompts) -> list[str | list[int]]:
    if isinstance(prompts, str):
        return [prompts]
    if not isinstance(prompts, Sequence):
        raise RequestError(f"prompts must be a string, a list of strings or a list of token-id lists, "
                           f"got {type(prompts).__name__}", field="prompt")
    items = list(prompts)
    if items and all(isinstance(t, int) and not isinstance(t, bool) for t in items):
        return [items]  # one prompt given as token ids
    return [p if isinstance(p, str) else list(p) if isinstance(p, Sequence) else p for p in items]


def _as_params_list(params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if params is None or isinstance(params, SamplingParams):
        return [params or SamplingParams()] * n
    params = list(params)
    if len(params) != n:
        raise RequestError(f"params: got {len(params)} SamplingParams for {n} prompts; pass one, or one per "
                           f"prompt", field="params")
    return params


def _progress(total: int, enabled: bool) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="generate", unit="req", disable=not enabled)
