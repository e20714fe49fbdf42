"""Outside the chapter (the model §4's forward step runs): load a Hugging Face directory,
config.json + *.safetensors -> DecoderForCausalLM, each tensor into the parameter of its name."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig, PretrainedConfig

from nanoserve.models.decoder import DecoderForCausalLM, check_config


def load_config(model_dir: str) -> PretrainedConfig:
    if not (Path(model_dir) / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in model directory {model_dir!r}")
    config = AutoConfig.from_pretrained(model_dir)
    check_config(config)
    return config


# HF's separate tensors -> (the merged parameter's module, which part of it): vLLM's
# `stacked_params_mapping`, nano-vllm's `packed_modules_mapping`.
STACKED_PARAMS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"),
                  "gate_up_proj": ("gate_proj", "up_proj")}


def checkpoint_names(model: DecoderForCausalLM) -> dict[str, tuple[str, int]]:
    """Every tensor the checkpoint must hold -> (the parameter it loads into, its part)."""
    names = {}
    for param_name, _ in model.named_parameters():  # tied weights appear once
        *path, module, kind = param_name.split(".")
        for part, hf_module in enumerate(STACKED_PARAMS.get(module, (module,))):
            names[".".join([*path, hf_module, kind])] = (param_name, part)
    return names


def load_weights(model: DecoderForCausalLM, model_dir: str) -> None:
    """Each checkpoint tensor into its parameter, read from the memory-mapped file; a merged or
    parallel linear's `weight_loader` reads only its part (and this rank's slice of it)."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in model directory {model_dir!r}")
    params, modules = dict(model.named_parameters()), dict(model.named_modules())
    missing, unexpected = checkpoint_names(model), []
    tied = getattr(model.config, "tie_word_embeddings", False)
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            names = f.keys()
        for name in names:  # the file mapped for one tensor at a time: its pages leave with it
            with safe_open(str(file), framework="pt", device="cpu") as f:
                if name.endswith("rotary_emb.inv_freq"):
                    continue  # older checkpoints save RoPE frequencies; we compute them
                if tied and name == "lm_head.weight":
                    continue  # HF ignores it too when embeddings are tied
                if name not in missing:
                    unexpected.append(name)
                    continue
                (target, part), tensor = missing.pop(name), f.get_slice(name)
                param, module = params[target], modules[target.rpartition(".")[0]]
                shape = module.full_shape(param, part) if hasattr(module, "full_shape") \
                    else tuple(param.shape)
                if tuple(tensor.get_shape()) != shape:
                    raise ValueError(f"{name}: checkpoint shape {tuple(tensor.get_shape())} "
                                     f"!= model shape {shape}")
                if hasattr(module, "weight_loader"):
                    module.weight_loader(param, tensor, part)
                else:
                    param.copy_(tensor[:])  # converts dtype and moves to the model's device
    if missing or unexpected:
        raise ValueError(f"checkpoint in {model_dir!r} does not match the model: "
                         f"missing {sorted(missing)}, unexpected {sorted(unexpected)}")


@torch.no_grad()
def load_model(model_dir: str, dtype: torch.dtype, device: torch.device, tp_size: int = 1,
               tp_rank: int = 0) -> tuple[DecoderForCausalLM, PretrainedConfig]:
    """The model (tensor parallel: this rank's shard of it), its weights loaded."""
    config = load_config(model_dir)
    # Build on the meta device: no memory and no random init for weights we overwrite.
    with torch.device("meta"):
        model = DecoderForCausalLM(config, tp_size, tp_rank)
    model = model.to(dtype).to_empty(device=torch.device(device))
    if getattr(config, "tie_word_embeddings", False):
        model.lm_head.weight = model.model.embed_tokens.weight  # to_empty unties them
    model.model.rotary_emb.reset_cache(torch.device(device))  # fp32 tables, not `dtype`
    load_weights(model, model_dir)
    return model.requires_grad_(False).eval(), config
