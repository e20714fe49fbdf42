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


def load_weights(model: DecoderForCausalLM, model_dir: str) -> None:
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in model directory {model_dir!r}")
    params = dict(model.named_parameters())  # tied weights appear once, under embed_tokens
    tied = getattr(model.config, "tie_word_embeddings", False)
    missing, unexpected = set(params), []
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                if name.endswith("rotary_emb.inv_freq"):
                    continue  # older checkpoints save RoPE frequencies; we compute them
                if tied and name == "lm_head.weight":
                    continue  # HF ignores it too when embeddings are tied
                if name not in params:
                    unexpected.append(name)
                    continue
                tensor, param = f.get_tensor(name), params[name]
                if tensor.shape != param.shape:
                    raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} "
                                     f"!= model shape {tuple(param.shape)}")
                param.copy_(tensor)  # converts dtype and moves to the model's device
                missing.discard(name)
    if missing or unexpected:
        raise ValueError(f"checkpoint in {model_dir!r} does not match the model: "
                         f"missing {sorted(missing)}, unexpected {sorted(unexpected)}")


@torch.no_grad()
def load_model(model_dir: str, dtype: torch.dtype,
               device: torch.device) -> tuple[DecoderForCausalLM, PretrainedConfig]:
    config = load_config(model_dir)
    # Build on the meta device: no memory and no random init for weights we overwrite.
    with torch.device("meta"):
        model = DecoderForCausalLM(config)
    model = model.to(dtype).to_empty(device=torch.device(device))
    if getattr(config, "tie_word_embeddings", False):
        model.lm_head.weight = model.model.embed_tokens.weight  # to_empty unties them
    model.model.rotary_emb.reset_cache(torch.device(device))  # fp32 tables, not `dtype`
    load_weights(model, model_dir)
    return model.requires_grad_(False).eval(), config
