"""Models of real shapes with random weights, built from their configurations (nothing is downloaded): what --bench
(--bench-shape gpt2-small) and python -m tepokit.tools.gpu_check run, so that speed and memory are measured at the
sizes users train without a hub. The configurations are the models' config.json values (the shape alone: widths,
layers, heads, vocabulary, tied embeddings); the tokenizer is the task's characters, padded to the real
vocabulary with tokens no text encodes to. Random weights make near-uniform completions: every row runs to
--max-new-tokens, the worst case of the memory plan and the same work on both sides of a bench."""

from __future__ import annotations

import torch

from tepokit.plumbing.rundir import save_pretrained_atomically
from tepokit.setup.model import END, builtin_tokenizer

QWEN25 = dict(vocab_size=151936, max_position_embeddings=32768, tie_word_embeddings=True, rope_theta=1e6,
              rms_norm_eps=1e-6, num_key_value_heads=2)
# name: (architecture, its configuration's shape)
SHAPES = {
    "gpt2-small": ("gpt2", dict(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12)),
    "qwen2.5-0.5b": ("qwen2", dict(QWEN25, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                   num_attention_heads=14)),
    "qwen2.5-1.5b": ("qwen2", dict(QWEN25, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                   num_attention_heads=12)),
    "qwen2.5-3b": ("qwen2", dict(QWEN25, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                                 num_attention_heads=16)),
}
# --micro (gpu_check's check of itself on a CPU): the same architectures and vocabularies, 2 layers of width 64
MICRO = {"gpt2": dict(n_positions=1024, n_embd=64, n_layer=2, n_head=4),
         "qwen2": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)}


def shape_config(shape: str, micro: bool = False):
    """The transformers configuration of SHAPES[shape] (micro: 2 layers of width 64, the real vocabulary), with no
    dropout (RL's ratios must be exactly 1 on the first mini-batch)."""
    from transformers import GPT2Config, Qwen2Config
    arch, values = SHAPES[shape]
    values = {**values, **(MICRO[arch] if micro else {})}
    if arch == "gpt2":
        return GPT2Config(**values, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return Qwen2Config(**values, attention_dropout=0.0)


def save_random_model(shape: str, task, seed: int, path: str, micro: bool = False, dtype=torch.float32,
                      device: str = "cpu") -> str:
    """A random-weight model of `shape` (seeded) with the task's character tokenizer padded to its vocabulary,
    saved to `path` in `dtype` (runs load it in fp32 whatever it was saved in); initialised on `device` (a GPU
    makes a 3B model's weights in a second, a CPU in a minute). Returns path."""
    from transformers import AutoModelForCausalLM
    config = shape_config(shape, micro)
    tokenizer = builtin_tokenizer(task, vocab_size=config.vocab_size)
    end = tokenizer.convert_tokens_to_ids(END)
    config.bos_token_id = config.eos_token_id = config.pad_token_id = end
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.generation_config.pad_token_id = end
    save_pretrained_atomically(model, tokenizer, path)
    return path
