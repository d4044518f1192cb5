"""One HTTP request's generation: its engine requests, their outputs as they come, and cleanup.

A completions call with several prompts, or ``n`` samples, fans out into
engine requests whose outputs share one asyncio queue. Each output comes
tagged with its prompt's index, and becomes the OpenAI choice
``prompt_index * n + sample index``.
Whatever way the HTTP exchange ends — finished, client gone, server error
— :meth:`Generation.abort_unfinished` stops what is still running, so a
client that disconnects frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

from kunlun_infer.engine.outputs import RequestOutput
from kunlun_infer.engine.intake import PreparedRequest
from kunlun_infer.errors import RequestError
from kunlun_infer.server.protocol import ApiError


class Generation:
    """The engine requests behind one HTTP request. Build, :meth:`start`, then iterate :meth:`outputs`."""

    def __init__(self, engine_loop: Any, requests: list[PreparedRequest], *, streamed: bool = True,
                 prompt_only: bool = False) -> None:
        """``requests``: one per prompt, prepared by the engine with the same params; ``streamed``: the client sees
        outputs as they come (else only the final ones, so the requests may start over elsewhere);
        ``prompt_only``: the client asked for no tokens (a prompt scored, ``max_tokens=0``), so the one token
        each request generates with its prompt's last logits is left out of the outputs and the usage."""
        self.engine_loop = engine_loop
        self.streamed = streamed
        self.prompt_only = prompt_only
        self.requests = requests
        self.n = requests[0].params.n
        self.queue: asyncio.Queue = asyncio.Queue()
        #: what the engine loop took, by prompt index
        self.submissions: list[Any] = []
        self._samples_left = len(requests) * self.n
        self.finals: dict[int, RequestOutput] = {}

    @property
    def num_choices(self) -> int:
        return len(self.requests) * self.n

    def start(self) -> None:
        """Submit every prompt; if one is refused (queue full), the ones already in are aborted."""
        try:
            for index, request in enumerate(self.requests):
                self.submissions.append(self.engine_loop.submit(request, self.queue, tag=index,
                                                                replayable=not self.streamed))
        except BaseException:
            self.abort_unfinished()
            raise

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """``(choice index, output)`` as the engine produces them, until every choice finished."""
        while self._samples_left:
            index, item = await self.queue.get()
            if isinstance(item, BaseException):
                self.abort_unfinished()
                if isinstance(item, RequestError):
                    raise ApiError.from_request_error(item)
                raise item
            choice = index * self.n + item.index
            if self.prompt_only:
                item = dataclasses.replace(item, token_ids=[], text="", delta_text="",
                                           logprobs=None if item.logprobs is None else [],
                                           finish_reason="length" if item.finish_reason in ("stop", "length")
                                           else item.finish_reason)
            if item.finished:
                self._samples_left -= 1
                self.finals[choice] = item
                if item.finish_reason == "abort":
                    self.abort_unfinished()
                    reason = (getattr(item, "error", None) or self.engine_loop.last_step_error
                              or "the server stopped it")
                    raise ApiError(f"the request was aborted: {reason}", status=500, type="server_error")
            yield choice, item

    def abort_unfinished(self) -> None:
        """Abort every engine request of this generation that has not finished (idempotent)."""
        for index, submission in enumerate(self.submissions):
            if not all(index * self.n + k in self.finals for k in range(self.n)):
                self.engine_loop.abort(submission)
        self._samples_left = 0

    @property
    def usage(self) -> dict[str, int]:
        prompt = sum(len(r.prompt_token_ids) for r in self.requests)
        completion = sum(len(o.token_ids) for o in self.finals.values())
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
