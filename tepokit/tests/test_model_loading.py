"""tepokit/setup/model.py's load_policy as a GPU run meets it: gradient checkpointing without transformers'
deprecation warning, and one "Loading weights" bar per model, not a second one for its reference model."""
import warnings

import torch

import train_small as ts
from tepokit.cli.flags import parse_args
from tepokit.setup.model import build_char_tokenizer, load_policy


def test_a_model_loads_with_checkpointing_silently_and_its_reference_model_without_a_second_bar(tmp_path, capsys):
    from transformers import GPT2Config, GPT2LMHeadModel
    tokenizer = build_char_tokenizer(["abc"])
    end = tokenizer.eos_token_id
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=64, n_embd=16, n_layer=2, n_head=2, bos_token_id=end,
                        eos_token_id=end, pad_token_id=end)
    GPT2LMHeadModel(config).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    path = str(tmp_path / "model")
    args, _ = parse_args(ts.Args, ["--model", path, "--gradient-checkpointing"])
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)        # a deprecated name would fail here
        model, _ = load_policy(path, args, torch.device("cpu"))
        load_policy(path, args, torch.device("cpu"))         # the reference model
    assert all(block.gradient_checkpointing for block in model.transformer.h)
    assert capsys.readouterr().err.count("Loading weights: 100%") == 1      # a bar's last state, once
