"""Train the small default model that ships inside ``kunlun_infer``.

``kunlun_infer.LLM()`` without a model path loads the Hugging Face style folder
``src/kunlun_infer/default_model/``.  This script produces that folder from
scratch, with no download: it trains a byte-level BPE tokenizer and a tiny
Llama-architecture decoder on the Python standard library sources of the
interpreter that runs it, so the shipped model writes Python-looking code.

Usage (from the repository root, with the project's virtualenv)::

    # the run that produced the shipped model (prints and records the step count)
    python scripts/train_default_model.py --out src/kunlun_infer/default_model --max-minutes 28

    # reproduce a recorded run exactly: same interpreter (its stdlib is the
    # corpus), same torch / tokenizers versions, same thread count
    python scripts/train_default_model.py --out src/kunlun_infer/default_model --steps N

    # a one minute smoke run to a scratch folder
    python scripts/train_default_model.py --out /tmp/km --max-minutes 1

What it does:

* Corpus: every ``.py`` file under ``sysconfig.get_paths()["stdlib"]``, minus
  ``site-packages``, the test suites (any ``test``/``tests``/``idle_test``
  folder), ``idlelib``, ``pydoc_data``, ``turtledemo``, ``ensurepip``,
  ``config-*`` and the generated ``encodings`` code-page tables.  Files are
  sorted by relative path and split train/validation by a SHA-256 of the
  relative path (about 2% validation), so the split never depends on the
  file system order.  Files are joined with the ``<|endoftext|>`` token.
* Tokenizer: byte-level BPE (``tokenizers``), vocab 4096, trained on the
  train split only; ``tokenizer.json`` plus a ``tokenizer_config.json`` that
  ``transformers.AutoTokenizer`` loads.  Decoding an encoding gives back the
  exact source text (checked on every validation file).
* Model: a Llama decoder (RMSNorm, rotary embeddings, grouped-query attention,
  SwiGLU MLP, tied input/output embeddings) written in plain torch with the
  parameter names of ``transformers.LlamaForCausalLM``, so the saved folder
  loads there and computes the same logits.
* Training: AdamW, linear warmup then cosine decay, random windows of
  ``--seq-len`` tokens, bfloat16 autocast (float32 weights), everything seeded.  With ``--max-minutes`` the step
  count is chosen after timing the first (warmup) steps; the warmup part of
  the learning-rate schedule does not depend on the total, so rerunning with
  ``--steps`` set to the recorded count repeats the run step for step.
* Output: ``config.json``, ``generation_config.json``, ``model.safetensors``,
  ``tokenizer.json``, ``tokenizer_config.json``, ``training.json`` (corpus
  stats, losses, steps, seed, timings, checks and sample generations) and a
  short ``README.md``.
* Checks (skipped with ``--no-verify``): reloads the folder with
  ``transformers``, records missing/unexpected weights, the largest logit
  difference against this script's model, tokenizer round trips, and greedy
  generations for a few prompts.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

EOT = "<|endoftext|>"
#: chat template for a code model: the conversation as Python comments, the assistant's turn as plain code
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{ message['content'] ~ eos_token ~ '\\n' }}"
    "{%- else -%}"
    "{{ '# ' ~ message['role'] ~ ': ' ~ (message['content'] | replace('\\n', '\\n# ')) ~ '\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
)
SAMPLE_PROMPTS = [
    "def fibonacci(n):",
    "import os\n",
    "class Stack:\n    def __init__(self):",
    "for i in range(10):",
]

# Folder names (any path component) that are left out of the corpus.
EXCLUDED_DIRS = {
    "site-packages",
    "dist-packages",
    "__pycache__",
    "test",
    "tests",
    "idle_test",
    "idlelib",
    "pydoc_data",
    "turtledemo",
    "ensurepip",
    "__phello__",
}
MAX_FILE_BYTES = 512 * 1024


# --------------------------------------------------------------------------
# corpus


def collect_corpus(stdlib: Path, val_per_10000: int) -> tuple[list[tuple[str, str]], list[tuple[str, str]], dict]:
    """Return (train, val) lists of (relative path, text), sorted by path."""
    skipped = {"excluded_dir": 0, "too_large": 0, "not_utf8": 0, "codec_table": 0, "empty": 0}
    files: list[tuple[str, str]] = []
    for root, dirs, names in os.walk(stdlib):
        dirs.sort()
        for name in sorted(names):
            if not name.endswith(".py"):
                continue
            path = Path(root) / name
            rel = path.relative_to(stdlib).as_posix()
            parts = rel.split("/")[:-1]
            if any(p in EXCLUDED_DIRS or p.startswith("config-") for p in parts):
                skipped["excluded_dir"] += 1
                continue
            data = path.read_bytes()
            if len(data) > MAX_FILE_BYTES:
                skipped["too_large"] += 1
                continue
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError:
                skipped["not_utf8"] += 1
                continue
            if parts[:1] == ["encodings"] and "gencodec.py" in text:
                skipped["codec_table"] += 1
                continue
            if not text.strip():
                skipped["empty"] += 1
                continue
            files.append((rel, text))
    files.sort()
    train, val = [], []
    for rel, text in files:
        h = int.from_bytes(hashlib.sha256(rel.encode("utf-8")).digest()[:8], "big")
        (val if h % 10000 < val_per_10000 else train).append((rel, text))
    return train, val, skipped


def corpus_digest(files: list[tuple[str, str]]) -> str:
    h = hashlib.sha256()
    for rel, text in files:
        h.update(rel.encode("utf-8") + b"\0" + text.encode("utf-8") + b"\0")
    return h.hexdigest()


# --------------------------------------------------------------------------
# tokenizer


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def encode_files(tok, texts: list[str], eot_id: int) -> torch.Tensor:
    """One token stream: file, <|endoftext|>, file, <|endoftext|>, ..."""
    ids: list[int] = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eot_id)
    return torch.tensor(ids, dtype=torch.int32)


# --------------------------------------------------------------------------
# model: the LlamaForCausalLM computation, same parameter names


@dataclass
class ModelConfig:
    vocab_size: int = 4096
    hidden_size: int = 256
    intermediate_size: int = 704
    num_hidden_layers: int = 6
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    max_position_embeddings: int = 1024
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = True
    initializer_range: float = 0.02


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_tables(cfg: ModelConfig, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    freqs = positions[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(h, cfg.num_attention_heads * d, bias=False)
        self.k_proj = nn.Linear(h, cfg.num_key_value_heads * d, bias=False)
        self.v_proj = nn.Linear(h, cfg.num_key_value_heads * d, bias=False)
        self.o_proj = nn.Linear(cfg.num_attention_heads * d, h, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        d = self.cfg.head_dim
        q = self.q_proj(x).view(b, t, -1, d).transpose(1, 2)
        k = self.k_proj(x).view(b, t, -1, d).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, d).transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        groups = self.cfg.num_attention_heads // self.cfg.num_key_value_heads
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=d**-0.5)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self._init_weights()

    def _init_weights(self) -> None:
        std = self.cfg.initializer_range
        # residual-branch outputs start smaller so the stream stays O(1) in depth
        out_std = std / math.sqrt(2 * self.cfg.num_hidden_layers)
        for name, p in self.named_parameters():
            if p.ndim == 1:
                nn.init.ones_(p)
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                nn.init.normal_(p, 0.0, out_std)
            else:
                nn.init.normal_(p, 0.0, std)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        positions = torch.arange(input_ids.shape[1]).unsqueeze(0)
        cos, sin = rope_tables(self.cfg, positions, x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.model.norm(x))

    def export_state_dict(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        out = {}
        for name, t in self.state_dict().items():
            if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
                continue  # tied to model.embed_tokens.weight: stored once
            out[name] = t.detach().to(dtype).contiguous().clone()
        return out


def hf_config(cfg: ModelConfig, dtype_name: str, eot_id: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "initializer_range": cfg.initializer_range,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "use_cache": True,
        "bos_token_id": eot_id,
        "eos_token_id": eot_id,
        "pad_token_id": None,
        "torch_dtype": dtype_name,
        "dtype": dtype_name,
    }


# --------------------------------------------------------------------------
# training helpers


def lr_at(step: int, total: int, warmup: int, lr: float, min_lr: float) -> float:
    """Linear warmup (independent of ``total``), then cosine decay to ``min_lr``."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def windows(stream: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Non-overlapping (seq_len + 1)-token windows, stride seq_len."""
    n = (len(stream) - 1) // seq_len
    return torch.stack([stream[i * seq_len : i * seq_len + seq_len + 1] for i in range(n)]).long()


@torch.no_grad()
def evaluate(model: CausalLM, wins: torch.Tensor, batch: int) -> float:
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(wins), batch):
        w = wins[i : i + batch]
        logits = model(w[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1), reduction="sum")
        total += loss.item()
        count += w[:, 1:].numel()
    model.train()
    return total / count


def log(msg: str) -> None:
    print(msg, flush=True)


# --------------------------------------------------------------------------
# checks with transformers


def verify(out: Path, model: CausalLM, val_texts: list[str], sample_ids: torch.Tensor, max_new_tokens: int) -> dict:
    import logging

    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    report: dict = {"transformers_version": transformers.__version__}

    # capture transformers' own load-time warnings
    records: list[str] = []

    class Grab(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    grab = Grab(level=logging.WARNING)
    tlog = logging.getLogger("transformers")
    tlog.addHandler(grab)
    try:
        tok = AutoTokenizer.from_pretrained(out)
        hf, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True, dtype=torch.float32)
    finally:
        tlog.removeHandler(grab)
    hf.eval()
    report["load_info"] = {k: sorted(map(str, v)) for k, v in info.items()}
    report["load_warnings"] = records
    report["hf_class"] = type(hf).__name__
    report["hf_tokenizer_class"] = type(tok).__name__

    max_len, tok.model_max_length = tok.model_max_length, 10**9  # whole files, no length warning
    extra = ["\tx = 1  \r\n", "  \n\n    pass\n", "s = 'h\u00e9llo \u4e16\u754c \U0001f600'\n", " leading space", ""]
    texts = val_texts + extra
    roundtrip_ok = sum(tok.decode(tok.encode(t, add_special_tokens=False)) == t for t in texts)
    tok.model_max_length = max_len
    report["tokenizer_roundtrip"] = f"{roundtrip_ok}/{len(texts)} ({len(val_texts)} validation files + {len(extra)} edge cases)"

    # this script's model, with the weights exactly as stored, against transformers
    ref = CausalLM(model.cfg)
    stored = {k: v.float() for k, v in model.export_state_dict(STORE_DTYPE).items()}
    ref.load_state_dict(stored, strict=not model.cfg.tie_word_embeddings)
    ref.eval()
    with torch.no_grad():
        mine = ref(sample_ids)
        theirs = hf(sample_ids).logits
    report["logits_max_abs_diff_vs_transformers"] = (mine - theirs).abs().max().item()
    eager = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        report["logits_max_abs_diff_vs_transformers_eager"] = (mine - eager(sample_ids).logits).abs().max().item()
    del eager
    report["logits_check_shape"] = list(sample_ids.shape)

    samples = []
    for prompt in SAMPLE_PROMPTS:
        enc = tok(prompt, return_tensors="pt", add_special_tokens=False)
        with torch.no_grad():
            gen = hf.generate(
                **enc,
                do_sample=False,
                max_new_tokens=max_new_tokens,
                pad_token_id=tok.eos_token_id,
            )
        text = tok.decode(gen[0], skip_special_tokens=False)
        samples.append({"prompt": prompt, "greedy": text})
    report["greedy_samples"] = samples
    return report


STORE_DTYPE = torch.float32


# --------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    global STORE_DTYPE
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path, help="output folder (Hugging Face layout)")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--max-minutes", type=float, default=28.0, help="wall-time budget of the whole run; the step count is derived from it (default 28)")
    g.add_argument("--steps", type=int, default=None, help="exact number of optimizer steps (reproduces a recorded run)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--min-lr", type=float, default=3e-4)
    ap.add_argument("--warmup", type=int, default=60, help="warmup steps (the step time is measured during them)")
    ap.add_argument("--amp", action=argparse.BooleanOptionalAction, default=True,
                    help="bfloat16 autocast for the training forward/backward (weights and evaluation stay float32)")
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--hidden-size", type=int, default=256)
    ap.add_argument("--intermediate-size", type=int, default=704)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--rope-theta", type=float, default=10000.0)
    ap.add_argument("--max-position-embeddings", type=int, default=1024)
    ap.add_argument("--untied", action="store_true", help="separate lm_head weights")
    ap.add_argument("--store-dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--val-per-10000", type=int, default=200, help="validation share of files, per 10000 (default 200 = 2%%)")
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--evals", type=int, default=5, help="validation evaluations during training")
    ap.add_argument("--eval-windows", type=int, default=64, help="validation windows used during training (all at the end)")
    ap.add_argument("--max-new-tokens", type=int, default=60)
    ap.add_argument("--no-verify", action="store_true", help="skip the transformers checks")
    args = ap.parse_args(argv)

    t_start = time.perf_counter()
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    os.environ.setdefault("RAYON_NUM_THREADS", str(args.threads))
    STORE_DTYPE = getattr(torch, args.store_dtype)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)

    # ---- corpus
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    train_files, val_files, skipped = collect_corpus(stdlib, args.val_per_10000)
    train_texts = [t for _, t in train_files]
    val_texts = [t for _, t in val_files]
    log(f"corpus: {stdlib}  train {len(train_files)} files / {sum(map(len, train_texts))} chars, "
        f"val {len(val_files)} files / {sum(map(len, val_texts))} chars, skipped {skipped}")

    # ---- tokenizer
    t0 = time.perf_counter()
    tok = train_tokenizer(train_texts, args.vocab_size)
    eot_id = tok.token_to_id(EOT)
    tok.save(str(out / "tokenizer.json"))
    tok_seconds = time.perf_counter() - t0
    train_stream = encode_files(tok, train_texts, eot_id)
    val_stream = encode_files(tok, val_texts, eot_id)
    log(f"tokenizer: vocab {tok.get_vocab_size()}, eot id {eot_id}, trained in {tok_seconds:.1f}s; "
        f"train {len(train_stream)} tokens, val {len(val_stream)} tokens")
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
    with open(out / "tokenizer_config.json", "w") as f:
        json.dump(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": None,
                "eos_token": EOT,
                "unk_token": None,
                "pad_token": None,
                "add_bos_token": False,
                "add_eos_token": False,
                "add_prefix_space": False,
                "clean_up_tokenization_spaces": False,
                "model_max_length": args.max_position_embeddings,
            },
            f,
            indent=2,
        )
        f.write("\n")

    # ---- model
    cfg = ModelConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.hidden_size // args.heads,
        max_position_embeddings=args.max_position_embeddings,
        rope_theta=args.rope_theta,
        tie_word_embeddings=not args.untied,
    )
    model = CausalLM(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: {asdict(cfg)}  parameters {n_params}")

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )

    data_gen = torch.Generator().manual_seed(args.seed)
    val_wins = windows(val_stream, args.seq_len)
    val_wins_small = val_wins[: args.eval_windows]
    pick = torch.Generator().manual_seed(args.seed + 1)
    train_probe = torch.randint(0, len(train_stream) - args.seq_len - 1, (len(val_wins),), generator=pick)
    train_probe_wins = torch.stack([train_stream[i : i + args.seq_len + 1] for i in train_probe.tolist()]).long()
    hi = len(train_stream) - args.seq_len - 1

    def batch() -> torch.Tensor:
        starts = torch.randint(0, hi, (args.batch_size,), generator=data_gen).tolist()
        return torch.stack([train_stream[s : s + args.seq_len + 1] for s in starts]).long()

    total_steps = args.steps
    step_seconds = None
    eval_seconds = None
    if total_steps is None:
        # warmup must cover the timing steps, so the schedule seen so far does not depend on the total
        if args.warmup < 12:
            ap.error("--warmup must be at least 12 when the step count comes from --max-minutes")
    evals_done: list[dict] = []
    recent: list[float] = []
    history: list[dict] = []
    eval_every = None
    t_train = time.perf_counter()
    t_mark = None
    step = 0
    while True:
        if total_steps is None and step == min(args.warmup, 40):
            # size the run: time measured over steps [4, step), one small eval, reserve for the end
            step_seconds = (time.perf_counter() - t_mark) / (step - 4)
            te = time.perf_counter()
            evaluate(model, val_wins_small, args.batch_size)
            eval_seconds = time.perf_counter() - te
            final_eval = eval_seconds * (2 * len(val_wins) / max(1, len(val_wins_small)))
            reserve = final_eval + 60.0 + (0 if args.no_verify else 30.0)
            left = args.max_minutes * 60 - (time.perf_counter() - t_start) - reserve
            per_step = step_seconds * 1.03 + eval_seconds * args.evals / 1000.0
            total_steps = max(args.warmup + 10, step + int(0.95 * left / per_step))
            log(f"timing: {step_seconds:.3f}s/step, eval {eval_seconds:.1f}s, {left:.0f}s left -> {total_steps} steps")
        if total_steps is not None and eval_every is None:
            eval_every = max(1, total_steps // (args.evals + 1))
        if total_steps is not None and step >= total_steps:
            break
        if step == 4:
            t_mark = time.perf_counter()
        lr = lr_at(step, total_steps or 10**9, args.warmup, args.lr, args.min_lr)
        for group in opt.param_groups:
            group["lr"] = lr
        w = batch()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.amp):
            logits = model(w[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), w[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip).item()
        opt.step()
        step += 1
        recent.append(loss.item())
        if step % args.log_every == 0 or step == 1:
            avg = sum(recent[-args.log_every :]) / len(recent[-args.log_every :])
            el = time.perf_counter() - t_start
            log(f"step {step}/{total_steps or '?'}  loss {avg:.4f}  lr {lr:.2e}  gnorm {gnorm:.2f}  elapsed {el:.0f}s")
            history.append({"step": step, "train_loss": round(avg, 4), "lr": lr, "elapsed_s": round(el, 1)})
        if eval_every and step % eval_every == 0 and step < total_steps:
            v = evaluate(model, val_wins_small, args.batch_size)
            evals_done.append({"step": step, "val_loss_subset": round(v, 4)})
            log(f"step {step}: val loss (first {len(val_wins_small)} windows) {v:.4f}")
    train_seconds = time.perf_counter() - t_train

    final_val = evaluate(model, val_wins, args.batch_size)
    final_train = evaluate(model, train_probe_wins, args.batch_size)
    last = recent[-50:]
    log(f"final: val loss {final_val:.4f} ({len(val_wins)} windows), train loss {final_train:.4f} "
        f"(probe), last-50-step train loss {sum(last) / len(last):.4f}, ln(vocab) {math.log(cfg.vocab_size):.4f}")

    # ---- save
    dtype_name = args.store_dtype
    with open(out / "config.json", "w") as f:
        json.dump(hf_config(cfg, dtype_name, eot_id), f, indent=2)
        f.write("\n")
    with open(out / "generation_config.json", "w") as f:
        json.dump({"bos_token_id": eot_id, "eos_token_id": eot_id, "pad_token_id": eot_id}, f, indent=2)
        f.write("\n")
    from safetensors.torch import save_file

    save_file(model.export_state_dict(STORE_DTYPE), str(out / "model.safetensors"), metadata={"format": "pt"})
    os.chmod(out / "model.safetensors", 0o644)

    sample_ids = val_wins[:2, : min(128, args.seq_len)]
    checks = None
    if not args.no_verify:
        checks = verify(out, model, val_texts, sample_ids, args.max_new_tokens)
        log(json.dumps(checks, indent=2))

    wall = time.perf_counter() - t_start
    sizes = {p.name: p.stat().st_size for p in sorted(out.iterdir()) if p.is_file() and p.name not in ("training.json", "README.md")}
    record = {
        "purpose": "default model of kunlun_infer, trained by scripts/train_default_model.py",
        "reproduce": f"python scripts/train_default_model.py --out {args.out} --steps {total_steps} --seed {args.seed}"
        + "".join(
            f" --{k.replace('_', '-')} {v}"
            for k, v in vars(args).items()
            if k not in ("out", "steps", "max_minutes", "seed", "no_verify", "untied", "amp") and v != ap.get_default(k)
        )
        + (" --untied" if args.untied else "")
        + ("" if args.amp else " --no-amp"),
        "seed": args.seed,
        "steps": total_steps,
        "eot_id": eot_id,
        "step_count_from": "--steps" if args.steps is not None else f"--max-minutes {args.max_minutes}",
        "hyperparameters": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "model": {**asdict(cfg), "parameters": n_params, "stored_dtype": dtype_name},
        "corpus": {
            "source": "CPython standard library .py files of the training interpreter",
            "stdlib_path": str(stdlib),
            "python": platform.python_version(),
            "train_files": len(train_files),
            "val_files": len(val_files),
            "val_file_names": [r for r, _ in val_files],
            "train_chars": sum(map(len, train_texts)),
            "val_chars": sum(map(len, val_texts)),
            "train_tokens": len(train_stream),
            "val_tokens": len(val_stream),
            "chars_per_token_train": round(sum(map(len, train_texts)) / len(train_stream), 3),
            "skipped_files": skipped,
            "sha256_train": corpus_digest(train_files),
            "sha256_val": corpus_digest(val_files),
        },
        "tokens_seen": total_steps * args.batch_size * args.seq_len,
        "epochs_seen": round(total_steps * args.batch_size * args.seq_len / len(train_stream), 3),
        "results": {
            "val_loss": round(final_val, 4),
            "val_windows": len(val_wins),
            "train_loss_probe": round(final_train, 4),
            "train_loss_last50_steps": round(sum(last) / len(last), 4),
            "ln_vocab": round(math.log(cfg.vocab_size), 4),
            "val_perplexity": round(math.exp(final_val), 3),
            "evals_during_training": evals_done,
        },
        "timing": {
            "wall_seconds": round(wall, 1),
            "train_seconds": round(train_seconds, 1),
            "tokenizer_seconds": round(tok_seconds, 1),
            "measured_step_seconds": step_seconds and round(step_seconds, 4),
            "threads": args.threads,
        },
        "software": {
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "tokenizers": __import__("tokenizers").__version__,
            "platform": platform.platform(),
        },
        "files_bytes": sizes,
        "train_loss_history": history,
        "checks": checks,
    }
    with open(out / "training.json", "w") as f:
        json.dump(record, f, indent=2)
        f.write("\n")
    write_readme(out, record)
    log(f"done in {wall:.0f}s; wrote {out}")
    return 0


def write_readme(out: Path, r: dict) -> None:
    m, c, res = r["model"], r["corpus"], r["results"]
    lines = [
        "# kunlun_infer default model",
        "",
        "A tiny Llama-architecture causal LM trained from scratch by",
        "`scripts/train_default_model.py` on the Python "
        f"{c['python']} standard library sources, so that `kunlun_infer.LLM()`",
        "works with no model path and no download. It writes Python-looking code; it",
        "is a test and demo model, not a useful assistant.",
        "",
        "Hugging Face layout: loads with `transformers.AutoModelForCausalLM` /",
        "`AutoTokenizer`. No BOS token is added by the tokenizer; `<|endoftext|>`",
        f"(id {r['eot_id']}) separates files in training and is the EOS token.",
        "",
        "| | |",
        "| --- | --- |",
        f"| layers / hidden / intermediate | {m['num_hidden_layers']} / {m['hidden_size']} / {m['intermediate_size']} |",
        f"| heads / kv heads / head dim | {m['num_attention_heads']} / {m['num_key_value_heads']} / {m['head_dim']} |",
        f"| vocab (byte-level BPE) | {m['vocab_size']} |",
        f"| tied embeddings | {m['tie_word_embeddings']} |",
        f"| parameters | {m['parameters']:,} ({m['stored_dtype']}) |",
        f"| corpus | {c['train_files']} train / {c['val_files']} val files, {c['train_tokens']:,} / {c['val_tokens']:,} tokens |",
        f"| steps x batch x seq | {r['steps']} x {r['hyperparameters']['batch_size']} x {r['hyperparameters']['seq_len']} ({r['epochs_seen']} epochs) |",
        f"| final val loss | {res['val_loss']} nats/token (ln vocab = {res['ln_vocab']}) |",
        f"| final train loss | {res['train_loss_probe']} |",
        f"| wall time | {r['timing']['wall_seconds']} s on {r['timing']['threads']} CPU threads |",
        f"| seed | {r['seed']} |",
        "",
        "Reproduce (same interpreter, torch and tokenizers versions, same thread count):",
        "",
        "```",
        r["reproduce"],
        "```",
        "",
        "`training.json` holds the full record: corpus stats, loss history, checks",
        "against `transformers` and greedy samples.",
        "",
    ]
    (out / "README.md").write_text("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
