"""The fleet's front: what the server asks of an engine, answered once for every replica.

The HTTP routes tokenize, render chat templates and check requests before
anything is queued; for a fleet that happens here, in the endpoint's
process, against the limits every replica meets (the smallest
``model.max_model_len``, KV cache and ``scheduler.max_num_seqs`` among
them), so any replica can take any request and a request that must move
never meets a tighter limit. The model folder (for its tokenizer and chat
template) is read here too: ``model.path`` names the same model on every
node. A structured-output constraint is compiled by a replica, whose
grammar backend will serve it.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

from kunlun_infer.engine.intake import PreparedRequest, Prompt, RequestIntake
from kunlun_infer.engine.params import SamplingParams
from kunlun_infer.engine.startup import model_dir, model_tokenizer
from kunlun_infer.errors import RequestError

#: seconds a replica may take to compile a structured-output constraint
COMPILE_TIMEOUT_S = 120.0


class RemoteCompiler:
    """Compiles structured-output constraints on a replica in rotation (its backend serves the requests)."""

    def __init__(self, loop: Any) -> None:
        self.loop = loop

    def compile(self, spec: Any) -> None:
        import ray

        handles = [r.handle for r in self.loop.replicas if r.state == "up"]
        if not handles:
            raise RequestError("structured: no replica of the fleet serves now to compile the constraint",
                               field="structured")
        refusal = ray.get(handles[0].check_structured.remote(spec), timeout=COMPILE_TIMEOUT_S)
        if refusal is not None:
            _, message, field = refusal
            raise RequestError(message, field=field or "structured")


class FleetFront:
    """The engine surface of a fleet for the server: tokenizer, model folder, limits, :meth:`prepare_request`."""

    def __init__(self, config: DictConfig, loop: Any) -> None:
        self.config = config
        self.model_path = model_dir(config.model.path)
        self.tokenizer = model_tokenizer(config.model.tokenizer, self.model_path)
        infos = [r.info for r in loop.replicas]
        self.vocab_size = int(infos[0]["vocab_size"])
        self.max_model_len = min(int(i["max_model_len"]) for i in infos)
        self.intake = RequestIntake(tokenizer=self.tokenizer, vocab_size=self.vocab_size,
                                    max_model_len=self.max_model_len,
                                    max_kv_tokens=min(int(i["kv_tokens"]) for i in infos),
                                    max_num_seqs=min(int(i["max_num_seqs"]) for i in infos),
                                    structured=RemoteCompiler(loop))

    def prepare_request(self, prompt: Prompt, params: SamplingParams | None = None) -> PreparedRequest:
        """Tokenize and check a request against every replica's limits (``RequestError`` naming the field)."""
        return self.intake.prepare(prompt, params)

    def close(self) -> None:
        """Nothing to release here: the fleet owns the replicas."""
