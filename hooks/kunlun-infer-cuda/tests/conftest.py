"""Fixtures the cuda plugin's tests share."""

import pytest
import torch


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """A tiny random transformers Llama (grouped-query attention) saved in float32 as safetensors, and the model
    itself; prompts are token ids (no tokenizer)."""
    transformers = pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("cuda-llama")
    config = transformers.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                      eos_token_id=299, bos_token_id=None, pad_token_id=None,
                                      tie_word_embeddings=False, initializer_range=0.2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.float32).eval()
    model.save_pretrained(folder, safe_serialization=True)
    return folder, model


@pytest.fixture(scope="session")
def tiny_llama_greedy(tiny_llama):
    """Token-id prompts of 1-150 tokens (block edges included) and transformers' 8 greedy tokens after each."""
    _, model = tiny_llama
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 299, (n,), generator=g).tolist() for n in (1, 15, 16, 17, 70, 150)]
    references = []
    with torch.no_grad():
        for p in prompts:
            out = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 max_new_tokens=8, do_sample=False, pad_token_id=299)
            references.append(out[0, len(p):].tolist())
    return prompts, references
