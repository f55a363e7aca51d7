"""LoRA through peft (tepokit/setup/lora.py) in train_small.py's own loop, on the CPU with models made on the spot:
a LoRA layer is y = W x + (alpha / r) B A x (float64, value and gradient); an RL step changes the adapters only; the
reference (the adapters switched off) is the base model; a resumed LoRA run equals an uninterrupted one; checkpoints
and the saved policy hold the adapters, and merge_lora folds them into a plain model; bad input is refused in one
line before anything is written; --dry-run plans Qwen2.5-3B with LoRA inside 24 GB. The plan against the live
bytes of LoRA runs is in test_memory_plan.py."""
import dataclasses
import json
import os
import sys

import pytest
import torch

import tepo
import train_small as ts
from tepokit.cli.flags import objective_config, parse_args
from tepokit.plumbing.rundir import trained_state
from tepokit.setup.lora import adapter_parameter_count, adapters_off, add_adapters, trainable_parameters
from tepokit.setup.model import build_char_tokenizer
from tepokit.tests.helpers import (F64, MICRO, assert_close, assert_refused_in_one_line, read_rows, run_main,
                                   without_timing)
from tepokit.tools import merge_lora
from tepokit.tools.memory import memory_plan, model_config_for_plan

pytest.importorskip("peft")

LORA = [*MICRO, "--objective", "grpo", "--beta", "0.04", "--lora-rank", "4", "--lora-alpha", "6"]


def tiny(model_type: str, dtype=torch.float32):
    """A two-layer Qwen2 or GPT-2 of width 16, dropout off, its weights drawn under seed 0."""
    from transformers import AutoModelForCausalLM, GPT2Config, Qwen2Config
    config = (Qwen2Config(vocab_size=40, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
              if model_type == "qwen2" else
              GPT2Config(vocab_size=40, n_embd=16, n_layer=2, n_head=2, n_positions=64, resid_pdrop=0.0,
                         embd_pdrop=0.0, attn_pdrop=0.0))
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).to(dtype).eval()


@pytest.mark.parametrize("model_type, layer_path", [("qwen2", "model.layers.1.mlp.up_proj"),
                                                     ("gpt2", "transformer.h.1.attn.c_attn")])
def test_a_lora_layer_is_w_x_plus_scaled_b_a_x_in_value_and_gradient(model_type, layer_path):
    """One adapted layer of a float64 model, B non-zero: its output, a loss of it and the loss's gradient with respect
    to A, B and the input equal a hand-written y = W x + b + (alpha / r) B A x (GPT-2's Conv1D stores W as [in, out]);
    the frozen W gets no gradient. The adapters count r x (in + out) per layer, as the memory plan counts them."""
    args = ts.Args(lora_rank=3, lora_alpha=5.0)
    base = tiny(model_type, F64)
    counted = adapter_parameter_count(base, args)
    model = add_adapters(base, args)
    assert sum(p.numel() for p in trainable_parameters(model)) == counted
    layer = model.get_submodule(f"base_model.model.{layer_path}")
    A, B = layer.lora_A["default"].weight, layer.lora_B["default"].weight          # [r, in], [out, r]
    with torch.no_grad():
        B.normal_()                                   # peft starts B at 0 (the base model); a trained B is not
    W, b = layer.base_layer.weight, layer.base_layer.bias
    torch.manual_seed(1)
    x = torch.randn(2, 5, A.shape[1], dtype=F64, requires_grad=True)
    weights = torch.randn(2, 5, B.shape[0], dtype=F64)
    y = layer(x)
    loss = (y * weights).sum()
    loss.backward()
    hand_A, hand_B, hand_x = (t.detach().clone().requires_grad_() for t in (A, B, x))
    base_out = hand_x @ W.detach() if model_type == "gpt2" else hand_x @ W.detach().T
    hand_y = base_out + (b.detach() if b is not None else 0) + 5.0 / 3 * (hand_x @ hand_A.T) @ hand_B.T
    hand_loss = (hand_y * weights).sum()
    hand_loss.backward()
    assert_close(y, hand_y)
    assert_close(loss, hand_loss)
    for got, want in ((A.grad, hand_A.grad), (B.grad, hand_B.grad), (x.grad, hand_x.grad)):
        assert_close(got, want)
    assert W.grad is None and not W.requires_grad


def capture_runs(monkeypatch) -> list:
    """train_small.start_run wrapped: each Run it makes is kept (its model after training)."""
    runs, start_run = [], ts.start_run

    def kept(*args, **kwargs):
        runs.append(start_run(*args, **kwargs))
        return runs[-1]
    monkeypatch.setattr(ts, "start_run", kept)
    return runs


def base_key(name: str) -> str:
    """A peft model's parameter name -> the base model's: base_model.model.X.base_layer.weight -> X.weight."""
    return name.removeprefix("base_model.model.").replace(".base_layer", "")


@pytest.fixture(scope="module")
def lora_run(workdir):
    """Two steps of GRPO (beta 0.04: the reference is the policy with its adapters off) with rank-4 adapters."""
    mp = pytest.MonkeyPatch()
    runs = capture_runs(mp)
    run_main([*LORA, "--steps", "2", "--out", "runs/lora"])
    mp.undo()
    return runs[0]


def test_an_rl_step_trains_the_adapters_only_and_the_reference_is_the_base_model(lora_run):
    """After two RL steps: every base weight bit-identical to the start model's, every B moved from 0; no separate
    reference model; with the adapters off the policy's logits are a separately loaded base model's, with them on
    they differ. The checkpoint holds the adapters and Adam's state for them only."""
    run = lora_run
    assert run.ref_model is run.model
    start = json.load(open("runs/lora/config.json"))["start_model"]
    base, _ = ts.load_policy(start, run.args, torch.device("cpu"))
    base_state = base.state_dict()
    frozen = [(n, p) for n, p in run.model.named_parameters() if not p.requires_grad]
    trained = [(n, p) for n, p in run.model.named_parameters() if p.requires_grad]
    assert len(frozen) == len(base_state) - 1          # GPT-2's lm_head is the embedding (tied): one parameter
    assert all(torch.equal(p, base_state[base_key(n)]) for n, p in frozen)
    assert trained and all("lora_" in n for n, _ in trained)
    assert all(p.abs().max() > 0 for n, p in trained if "lora_B" in n)
    ids = torch.randint(3, 20, (2, 9))
    with torch.no_grad(), adapters_off(run.ref_model, run.model):
        reference = run.ref_model(ids).logits
    with torch.no_grad():
        policy, original = run.model(ids).logits, base(ids).logits
    assert torch.equal(reference, original)
    assert (policy - original).abs().max() > 1e-4
    checkpoint = torch.load("runs/lora/checkpoint.pt", weights_only=True)
    assert sorted(checkpoint["model"]) == sorted(n for n, _ in trained)
    assert len(checkpoint["optimizer"]["state"]) == len(trained)
    assert sorted(os.listdir("runs/lora/policy")) == ["README.md", "adapter_config.json", "adapter_model.safetensors",
                                                      "tokenizer.json", "tokenizer_config.json"]
    adapter = json.load(open("runs/lora/policy/adapter_config.json"))
    assert (adapter["r"], adapter["lora_alpha"], adapter["lora_dropout"]) == (4, 6.0, 0.0)
    assert sorted(adapter["target_modules"]) == ["c_attn", "c_fc", "c_proj"]
    assert os.path.isabs(adapter["base_model_name_or_path"])


def test_merge_lora_folds_the_adapters_into_a_plain_model_with_the_same_logits(lora_run, tmp_path, capsys):
    """python -m tepokit.tools.merge_lora RUN/policy OUT: a plain model (no peft to load it) whose logits are the
    trained policy's; a bad input is one line and writes nothing."""
    from transformers import AutoModelForCausalLM
    out = str(tmp_path / "merged")
    assert merge_lora.main(["runs/lora/policy", out]) == 0
    assert "adapter_config.json" not in os.listdir(out) and "tokenizer.json" in os.listdir(out)
    merged = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(3, 20, (2, 9))
    with torch.no_grad():
        assert_close(merged(ids).logits, lora_run.model(ids).logits, atol=1e-5, rtol=1e-5)
    capsys.readouterr()
    for argv, needle in [(["runs/lora", str(tmp_path / "a")], "has no adapter_config.json"),
                         ([str(tmp_path / "none"), str(tmp_path / "b")], "is not a directory"),
                         (["runs/lora/policy", out], "is not an empty directory"),
                         (["runs/lora/policy", str(tmp_path / "c"), "--base", str(tmp_path)], "cannot load the base")]:
        with pytest.raises(SystemExit) as e:
            merge_lora.main(argv)
        lines = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(lines) == 1 and needle in lines[0], (argv, lines)
        assert lines[0].startswith("python -m tepokit.tools.merge_lora: error: ")
    assert sorted(os.listdir(tmp_path)) == ["merged"]


def test_a_resumed_lora_run_equals_the_uninterrupted_one(workdir):
    """Stopped after step 2 (--stop-after) and resumed: the same rows and the same adapters, bit for bit, as a run
    of 4 steps in one go; the checkpoints never hold the frozen base."""
    run_main([*LORA, "--steps", "4", "--out", "runs/lora_full"])
    run_main([*LORA, "--steps", "4", "--out", "runs/lora_cut", "--stop-after", "2"])
    run_main(["--resume", "runs/lora_cut"])
    assert without_timing(read_rows("runs/lora_cut")) == without_timing(read_rows("runs/lora_full"))
    full, cut = (torch.load(f"runs/{d}/checkpoint.pt", weights_only=True) for d in ("lora_full", "lora_cut"))
    assert full["step"] == cut["step"] == 4 and sorted(full["model"]) == sorted(cut["model"])
    assert all("lora_" in name for name in full["model"])
    assert all(torch.equal(full["model"][name], cut["model"][name]) for name in full["model"])


def test_a_full_fine_tuning_checkpoint_still_holds_every_weight():
    model = torch.nn.Linear(3, 2)
    assert sorted(trained_state(model)) == ["bias", "weight"]
    model.bias.requires_grad_(False)
    assert sorted(trained_state(model)) == ["weight"]


@pytest.mark.parametrize("flags, needles", [
    (["--lora-rank", "-1"], ["--lora-rank", "an integer >= 0"]),
    (["--lora-rank", "2.5"], ["--lora-rank", "an integer"]),
    (["--lora-rank", "4", "--lora-alpha", "0"], ["--lora-alpha", "a number > 0"]),
    (["--lora-rank", "4", "--lora-target-modules", "c_attn,,c_fc"], ["--lora-target-modules", "comma-separated"]),
    (["--lora-alpha", "8"], ["--lora-alpha", "without --lora-rank"]),
    (["--lora-target-modules", "c_fc"], ["--lora-target-modules", "without --lora-rank"]),
    (["--lora-rank", "4", "--lora-base-bf16"], ["--lora-base-bf16", "--precision bf16"]),
    (["--lora-base-bf16", "--precision", "bf16"], ["--lora-base-bf16", "--lora-rank > 0"]),
])
def test_bad_lora_input_is_refused_in_one_line_before_anything_is_written(flags, needles, workdir):
    """Refused in one line, exit status 2, no run directory: the values at parsing, a target module the model does
    not have with its config (the memory plan's meta model), before any weight is loaded."""
    assert_refused_in_one_line([*MICRO, "--steps", "1", *flags, "--out", "runs/refused"], *needles)
    assert not os.path.exists("runs/refused")


def test_a_target_module_the_model_does_not_have_is_refused_before_any_weight_is_loaded(workdir, capsys,
                                                                                        monkeypatch):
    """The memory plan counts the adapters on a meta model of the config: a target the model lacks ends the run there,
    in one line naming the layers it has, before the start model is made or loaded and the run directory created."""
    monkeypatch.setattr(ts, "prepare_start_model", lambda *a: pytest.fail("the start model was made"))
    with pytest.raises(SystemExit) as e:
        ts.main([*MICRO, "--lora-rank", "4", "--lora-target-modules", "q_proj,c_fc", "--out", "runs/refused"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("train_small.py: error: argument --lora-target-modules: invalid value 'q_proj,c_fc'")
    assert "no linear layer named 'q_proj'" in lines[0] and "c_attn, c_fc, c_proj" in lines[0]
    assert not os.path.exists("runs/refused")


def test_lora_without_peft_says_how_to_install_it(workdir, monkeypatch):
    monkeypatch.setitem(sys.modules, "peft", None)              # import peft now fails, as if not installed
    assert_refused_in_one_line([*MICRO, "--lora-rank", "4", "--out", "runs/refused"], "--lora-rank", "pip install")
    assert not os.path.exists("runs/refused")


# Qwen2.5's config.json values (Qwen/Qwen2.5-1.5B-Instruct, Qwen/Qwen2.5-3B-Instruct): the plan needs no weights
QWEN25 = {"1.5B": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12),
          "3B": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16)}
# docs/one-gpu.md's LoRA recipe on a 24 GB card
RECIPE_24GB = ["--dataset", "openai/gsm8k", "--max-new-tokens", "256", "--objective", "grpo", "--lora-rank", "16",
               "--lora-base-bf16", "--precision", "bf16", "--micro-batch-size", "4", "--gradient-checkpointing",
               "--lr", "1e-5"]


def qwen25_dir(path, size: str) -> str:
    """A model directory with Qwen2.5's config (and a character tokenizer: --model wants tokenizer files)."""
    from transformers import Qwen2Config
    Qwen2Config(vocab_size=151936, num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=32768,
                **QWEN25[size]).save_pretrained(path)
    build_char_tokenizer(["abc"]).save_pretrained(path)
    return str(path)


def test_dry_run_plans_qwen25_3b_with_lora_inside_24_gb(tmp_path, capsys, monkeypatch):
    """--dry-run of the 24 GB recipe with Qwen2.5-3B's config: the plan counts the frozen bf16 base and the
    adapters (r x (in + out) for each of the 7 projections of 36 layers), no reference model, and its peak, on a GPU
    (cuBLAS's workspaces counted), is under 24 GB; the same run without LoRA would not fit."""
    monkeypatch.chdir(tmp_path)
    model = qwen25_dir(tmp_path / "qwen3b", "3B")
    argv = ["--model", model, *RECIPE_24GB, "--device", "cpu", "--dry-run"]
    run_main(argv)
    out = capsys.readouterr().out
    assert "base weights, frozen (bf16)" in out and "LoRA adapters: Adam moments (fp32)" in out
    assert "reference model (fp32)" not in out and os.listdir(tmp_path) == ["qwen3b"]      # nothing written
    args, overrides = parse_args(ts.Args, argv)
    needs_ref = tepo.needs_ref(args.objective, objective_config(args, overrides))
    config = model_config_for_plan(args, None)
    plan = memory_plan(args, config, needs_ref, "cuda")
    per_layer = 16 * (2 * (2048 + 2048) + 2 * (2048 + 256) + 3 * (2048 + 11008))
    assert plan["n_adapters"] == 36 * per_layer == 29_933_568
    assert plan["peak"] < 24e9, plan["peak"] / 2**30
    full = memory_plan(dataclasses.replace(args, lora_rank=0, lora_base_bf16=False), config, needs_ref, "cuda")
    assert full["peak"] > 24e9


def test_the_trl_engine_gets_the_same_lora_settings(workdir):
    """--engine trl: TRL's GRPOTrainer gets the same rank, alpha, targets and zero dropout (peft_config), and its saved
    policy holds the adapters."""
    pytest.importorskip("trl")
    run_main([*LORA, "--engine", "trl", "--steps", "1", "--out", "runs/lora_trl"])
    adapter = json.load(open("runs/lora_trl/policy/adapter_config.json"))
    assert (adapter["r"], adapter["lora_alpha"], adapter["lora_dropout"]) == (4, 6.0, 0.0)
    assert sorted(adapter["target_modules"]) == ["c_attn", "c_fc", "c_proj"]
