"""The model's recommended sampling (vLLM's `--generation-config`): a model's creator may ship
defaults in generation_config.json (Qwen2.5: temperature 0.7, top_p 0.8, top_k 20; Llama 3.2
Instruct: temperature 0.6, top_p 0.9). As in vLLM, they replace SamplingParams' defaults for what
a request leaves unset: `LLM.generate` without sampling params, a server request without
`temperature`. "auto": the model's file; "vllm": none, SamplingParams' own; a folder: its file."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from transformers import GenerationConfig

from nanoserve.sampling_params import RequestOutputKind, SamplingParams

# generation_config.json's names -> SamplingParams' (HF's max_new_tokens is vLLM's max_tokens)
APPLIED = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
           "max_new_tokens": "max_tokens"}
NOT_APPLIED = {"repetition_penalty": 1.0, "min_p": 0.0}  # vLLM's too; nanoserve samples without


def sampling_defaults(source: str, model_dir: str) -> dict:
    """SamplingParams' settings the generation config sets ("auto", "vllm" or a folder)."""
    if source == "vllm":
        return {}
    folder = model_dir if source == "auto" else source
    if not isinstance(folder, str) or not (Path(folder) / "generation_config.json").is_file():
        if source == "auto":  # (a hub's file is never read: nothing is downloaded)
            return {}  # the model recommends nothing
        raise ValueError(f"generation_config must be 'auto', 'vllm' or a folder holding a "
                         f"generation_config.json, got {source!r}")
    given = GenerationConfig.from_pretrained(folder).to_diff_dict()
    for name, neutral in NOT_APPLIED.items():
        if given.get(name) not in (None, neutral):
            logging.getLogger("nanoserve").warning(
                "the generation config recommends %s=%s, which nanoserve does not apply", name,
                given[name])
    # (HF's top_k 0 is off, as SamplingParams' None)
    return {ours: given[name] for name, ours in APPLIED.items()
            if given.get(name) is not None and not (name == "top_k" and given[name] == 0)}


def request_params(req: Any, defaults: dict, max_tokens: int, logprobs: int | None
                   ) -> SamplingParams:
    """A server request's SamplingParams: what it sets, over `defaults` (the model's recommended,
    sampling_defaults' less max_tokens) for what it leaves unset, output as deltas (streamed).
    ValueError names the engine's field (the server answers with the request's name for it)."""
    given = {name: getattr(req, name) for name in ("temperature", "top_p", "top_k")
             if getattr(req, name) is not None}
    return SamplingParams(**{**defaults, **given}, seed=req.seed, max_tokens=max_tokens,
                          stop=req.stop, stop_token_ids=req.stop_token_ids or [], n=req.n,
                          include_stop_str_in_output=req.include_stop_str_in_output,
                          ignore_eos=req.ignore_eos, logprobs=logprobs,
                          output_kind=RequestOutputKind.DELTA)
