"""LoRA (Hu et al., 2021, "LoRA: Low-Rank Adaptation of Large Language Models") through peft, in tepo's own loop:
--lora-rank R puts a rank-R adapter B A (B zero at the start, so the first policy is the base model) beside each
target weight W, y = W x + (alpha / R) B A x; W stays frozen, only A and B are trained. The reference model is the
same model with its adapters switched off (adapters_off), so it costs no memory of its own.

What is kept where: the optimizer holds the adapters only (trainable_parameters); a checkpoint holds the trained
parameters only (tepokit/plumbing/rundir.py trained_state), the frozen base being the start model, loaded again
on --resume; the saved policy (<run>/policy/) holds the adapters (adapter_config.json, adapter_model.safetensors)
and the tokenizer, and `python -m tepokit.tools.merge_lora RUN/policy OUT` folds them into a plain model.

--lora-base-bf16 keeps the frozen base in bf16 (the whole base model: 2 bytes per weight instead of 4) and the
adapters in fp32, as peft does for a bf16 model (autocast_adapter_dtype). The base then computes in bf16, so the
flag needs --precision bf16 (tepokit/cli/validation.py refuses it under fp32: a fp32 forward would meet bf16
weights, and a run that says fp32 would compute in bf16)."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import warnings

import torch

from tepokit.plumbing.errors import fail

# The attention and MLP projections of the architectures tepo is tested with (--lora-target-modules auto); any
# other architecture gets every linear layer but the output head (peft's "all-linear").
TARGET_MODULES = {
    "gpt2": ["c_attn", "c_proj", "c_fc"],
    "qwen2": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
}
INSTALL_PEFT = "pip install 'peft>=0.21'"


def peft_installed() -> bool:
    """Whether peft can be imported (looked up, not imported: --help and a refused flag stay fast)."""
    return importlib.util.find_spec("peft") is not None


def lora_alpha(args) -> float:
    """alpha / rank is LoRA's scale; unset, alpha is 2 x rank (a scale of 2)."""
    return 2.0 * args.lora_rank if args.lora_alpha is None else float(args.lora_alpha)


def target_names(model_type: str, args) -> list[str] | str:
    """The module names the adapters go beside: --lora-target-modules, or auto's for the architecture."""
    if args.lora_target_modules == "auto":
        return TARGET_MODULES.get(model_type, "all-linear")
    return "all-linear" if args.lora_target_modules == "all-linear" else args.lora_target_modules.split(",")


def linear_layers(model) -> dict[str, tuple[int, int]]:
    """{module name: (in features, out features)} of every linear layer LoRA can adapt: torch's Linear and GPT-2's
    Conv1D (a linear layer whose weight is stored [in, out]), the output head (lm_head) left out."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    found = {}
    for name, module in model.named_modules():
        if module is head:
            continue
        if isinstance(module, torch.nn.Linear):
            found[name] = (module.in_features, module.out_features)
        elif type(module).__name__ == "Conv1D":                 # transformers.pytorch_utils.Conv1D
            found[name] = tuple(module.weight.shape)
    return found


def adapted_layers(model, args) -> dict[str, tuple[int, int]]:
    """The linear layers that get an adapter, by peft's rule (a module whose name is a target or ends with
    '.' + a target); refuses in one line a target that names no linear layer of the model."""
    layers = linear_layers(model)
    names = target_names(model.config.model_type, args)
    if names == "all-linear":
        return layers
    for target in names:
        if not any(name == target or name.endswith("." + target) for name in layers):
            have = sorted({name.rsplit(".", 1)[-1] for name in layers})
            fail(f"argument --lora-target-modules: invalid value {args.lora_target_modules!r}: this "
                 f"{model.config.model_type} model has no linear layer named {target!r}; choose auto or a "
                 f"comma-separated list of: {', '.join(have)}")
    return {name: shape for name, shape in layers.items()
            if any(name == target or name.endswith("." + target) for target in names)}


def adapter_parameter_count(model, args) -> int:
    """The adapters' parameters: r x (in + out) for each adapted layer (A is [r, in], B is [out, r]).
    Works on a model on the meta device (tepokit/tools/memory.py counts them from the config alone)."""
    return sum(args.lora_rank * (n_in + n_out) for n_in, n_out in adapted_layers(model, args).values())


def lora_config(model_type: str, args):
    """peft's LoraConfig of this run (also what --engine trl passes to TRL): rank, alpha, targets, no dropout
    (on-policy ratios must be exactly 1, tepokit/setup/model.py switch_off_dropout)."""
    from peft import LoraConfig
    return LoraConfig(r=args.lora_rank, lora_alpha=lora_alpha(args), lora_dropout=0.0,
                      target_modules=target_names(model_type, args), task_type="CAUSAL_LM",
                      fan_in_fan_out=model_type == "gpt2")             # GPT-2's Conv1D stores W as [in, out]


def peft_config_for(model_path: str, args):
    """--engine trl: the LoraConfig TRL's GRPOTrainer gets (peft_config), the same as tepo's own loop would use;
    None without --lora-rank. Its targets are checked against the model's config (a meta model: no weights)."""
    if not args.lora_rank:
        return None
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.from_pretrained(model_path, trust_remote_code=args.trust_remote_code)
    with torch.device("meta"):
        adapted_layers(AutoModelForCausalLM.from_config(config), args)     # refuses a target the model lacks
    return lora_config(config.model_type, args)


def add_adapters(model, args):
    """The model with LoRA adapters (peft), its base weights frozen (bf16 with --lora-base-bf16, the adapters
    fp32); the model itself when --lora-rank is 0. Called before the run directory is claimed: a refusal here
    leaves nothing behind."""
    if not args.lora_rank:
        return model
    if not peft_installed():
        fail(f"argument --lora-rank: LoRA needs peft, which is not installed; {INSTALL_PEFT}, or leave --lora-rank "
             "at 0")
    from peft import get_peft_model
    layers = adapted_layers(model, args)                      # refuses targets the model does not have
    n_adapter = sum(args.lora_rank * (n_in + n_out) for n_in, n_out in layers.values())
    n_base = sum(p.numel() for p in model.parameters())
    if args.lora_base_bf16:
        model = model.to(torch.bfloat16)
    with warnings.catch_warnings():       # peft asks transformers a deprecated question (is_gradient_checkpointing)
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        model = get_peft_model(model, lora_config(model.config.model_type, args))   # adapters fp32 over a bf16 base
    config = model.peft_config["default"]
    if config.base_model_name_or_path and os.path.exists(config.base_model_name_or_path):
        # merge_lora finds the base here, from any working directory
        config.base_model_name_or_path = os.path.abspath(config.base_model_name_or_path)
    trained = sum(p.numel() for p in trainable_parameters(model))
    assert trained == n_adapter, (trained, n_adapter)         # the memory plan counts them the same way
    print(f"LoRA: rank {args.lora_rank}, alpha {lora_alpha(args):g}, {len(layers)} layers "
          f"({', '.join(sorted(set(config.target_modules)))}); {trained:,} adapter parameters trained, the "
          f"{n_base:,} of the base frozen{' in bf16' if args.lora_base_bf16 else ''}", flush=True)
    return model


def uses_adapters(model) -> bool:
    return hasattr(model, "disable_adapter") and hasattr(model, "peft_config")


def adapters_off(ref_model, model):
    """The context in which ref_model computes the reference log-probs: with LoRA the reference IS the policy,
    with its adapters switched off; a separate reference model needs nothing."""
    return model.disable_adapter() if ref_model is model and uses_adapters(model) else contextlib.nullcontext()


def trainable_parameters(model) -> list[torch.nn.Parameter]:
    """The parameters the optimizer updates: every one, or with LoRA the adapters' only."""
    return [p for p in model.parameters() if p.requires_grad]
