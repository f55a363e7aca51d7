"""tepokit/model.py: the built-in tokenizer, loading a model (end tokens, dropout off), the warm-up cache."""
import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import torch

import train_small as ts
from tepokit.forward import completion_logits
from tepokit.model import build_char_tokenizer, eos_ids_of, load_policy, prepare_start_model, warmup_cache_dir
from tepokit.tests.helpers import MICRO, SCRIPT, micro_run, hand_batch


def test_char_tokenizer_round_trip_and_pad_is_eos():
    tok = build_char_tokenizer(["Ann has 3 pens.\n#### 3"])
    text = "Ann has 3 pens.\n3+4=7\n#### 7"
    ids = tok(text).input_ids
    assert len(ids) == len(text)
    assert tok.decode(ids) == text
    assert tok.pad_token_id == tok.eos_token_id and tok.padding_side == "left"


def test_stopping_on_every_end_token_of_the_model(tmp_path):
    """A model whose generation config names two end tokens (as Qwen2.5-Instruct: <|im_end|> and
    <|endoftext|>) stops on both, although its tokenizer names one: a completion ending in the
    second is masked after it and not counted as truncated."""
    from transformers import AutoModelForCausalLM, GenerationConfig, Qwen2Config
    tok = build_char_tokenizer(["ab"])
    tok.add_special_tokens({"additional_special_tokens": ["<|im_end|>"]})
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    config = Qwen2Config(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, eos_token_id=tok.eos_token_id)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config = GenerationConfig(eos_token_id=[im_end, tok.eos_token_id])
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    loaded, tokenizer = load_policy(str(tmp_path), ts.Args(), torch.device("cpu"))
    assert tokenizer.eos_token_id != im_end
    assert sorted(eos_ids_of(loaded)) == sorted([im_end, tokenizer.eos_token_id])
    a = tokenizer.convert_tokens_to_ids("a")
    ids = torch.tensor([[a, a, im_end, a, a], [a, a, a, a, a]])
    assert ts.completion_mask(ids, eos_ids_of(loaded)).tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]


def test_dropout_settings_are_off_also_in_train_mode_with_checkpointing(tmp_path):
    """A config whose attention reads the float `attention_dropout` (Qwen2), set to 0.5: after
    load_policy the update's first micro-batch is exactly on-policy in train() mode with gradient
    checkpointing; without switching the float settings off it is not."""
    from transformers import AutoModelForCausalLM, Qwen2Config
    tok = build_char_tokenizer(["abc 0123456789"])
    config = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, attention_dropout=0.5,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    args = ts.Args(gradient_checkpointing=True, group_size=4, prompts_per_step=2, mini_batches=2, max_new_tokens=6)
    batch = hand_batch(len(tok), rows=8, prompt=4, completion=6)
    # control: as loaded by transformers, train() mode applies the dropout: two forwards differ
    raw = AutoModelForCausalLM.from_pretrained(tmp_path).train()
    first, second = (completion_logits(raw, batch, torch.arange(8), args) for _ in range(2))
    assert (first - second).abs().max() > 1e-3
    model, tokenizer = load_policy(str(tmp_path), args, torch.device("cpu"))
    assert model.config.attention_dropout == 0.0 and model.is_gradient_checkpointing
    assert all(v == 0.0 for m in model.modules() for k, v in vars(m).items() if "dropout" in k
               and isinstance(v, float))
    run = micro_run(model, tokenizer, args, "grpo", beta=0.0)
    adv, keep = torch.randn(8), torch.ones(8, dtype=torch.bool)
    plan = ts.minibatch_plan(keep, args)
    stats = ts.rollout_statistics(run, batch, adv, plan)
    metrics = ts.update_policy(run, batch, stats, adv, plan)
    assert metrics["logprobs/first_minibatch_max_abs_log_ratio"] == 0.0


def test_cache_dir_flag_places_and_prints_the_warm_up_cache(tmp_path, capsys):
    args = ts.Args(cache_dir=str(tmp_path / "my-cache"))
    cache = warmup_cache_dir(args)
    assert cache.startswith(str(tmp_path / "my-cache" / "warmup-"))
    assert warmup_cache_dir(dataclasses.replace(args, cache_dir="elsewhere")).endswith(os.path.basename(cache))
    os.makedirs(cache)
    Path(cache, "config.json").write_text("{}")
    assert prepare_start_model(args, None, torch.device("cpu")) == cache
    assert cache in capsys.readouterr().out


@pytest.mark.parametrize("engine", ["tepo", "trl"])
def test_a_micro_run_prints_no_warning_and_no_transformers_bar(tmp_path, engine):
    """What a run prints is for the user: no warning they cannot act on (transformers' loss_type=None at the
    warm-up's first loss, TRL's FutureWarning) and no "Loading weights" / "Writing model shards" bars. The run
    starts in an empty directory, so the warm-up runs and saves its cache (where those showed)."""
    done = subprocess.run([sys.executable, SCRIPT, *MICRO, "--steps", "2", "--engine", engine, "--out", "run"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    printed = done.stdout + done.stderr
    assert done.returncode == 0, printed[-2000:]
    assert "held-out accuracy" in done.stdout                     # the run did print its result
    lines = re.split(r"[\r\n]+", printed)                         # a bar redraws itself with carriage returns
    assert [line for line in lines if re.search(r"warn", line, re.IGNORECASE)] == []
    assert [line for line in lines if re.search(r"Loading|Writing model shards|Fetching", line)] == []
