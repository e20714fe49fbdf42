"""The model's recommended sampling (vLLM's `--generation-config`): a model's creator may ship
defaults in generation_config.json (Qwen2.5: temperature 0.7, top_p 0.8, top_k 20; Llama 3.2
Instruct: temperature 0.6, top_p 0.9). As in vLLM, they replace SamplingParams' defaults for what
a request leaves unset: `LLM.generate` without sampling params, a server request without
`temperature`. "auto": the model's file; "vllm": none, SamplingParams' own; a folder: its file;
and over it, vLLM's `override_generation_config` (the file's names: {"temperature": 0.5})."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from transformers import GenerationConfig

from nanoserve.sampling_params import RequestOutputKind, SamplingParams

# generation_config.json's names -> SamplingParams' (HF's max_new_tokens is vLLM's max_tokens)
APPLIED = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
           "max_new_tokens": "max_tokens"}
FILE = "generation_config.json"
NOT_APPLIED = {"repetition_penalty": 1.0, "min_p": 0.0}  # vLLM's too; nanoserve samples without


def sampling_defaults(source: str, model_dir: str, overrides: dict | None = None) -> dict:
    """SamplingParams' settings the generation config sets ("auto", "vllm" or a folder), with
    `overrides` over it; checked as SamplingParams checks them (ValueError)."""
    if not isinstance(overrides, (dict, type(None))):
        raise ValueError(f"override_generation_config must be a dict (a JSON object) of "
                         f"generation config settings, got {overrides!r:.100}")
    folder = model_dir if source == "auto" else source
    if source == "vllm" or source == "auto" and not (Path(folder) / FILE).is_file():
        given = {}  # none asked for, or the model recommends nothing (no hub is asked)
    elif isinstance(folder, str) and (Path(folder) / FILE).is_file():
        given = GenerationConfig.from_pretrained(folder).to_diff_dict()
    else:
        raise ValueError(f"generation_config must be 'auto', 'vllm' or a folder holding a "
                         f"{FILE}, got {source!r}")
    given = {**given, **(overrides or {})}
    for name, neutral in NOT_APPLIED.items():
        if given.get(name) not in (None, neutral):
            logging.getLogger("nanoserve").warning(
                "the generation config recommends %s=%s, which nanoserve does not apply", name,
                given[name])
    # (HF's top_k 0 is off, as SamplingParams' None)
    defaults = {ours: given[name] for name, ours in APPLIED.items()
                if given.get(name) is not None and not (name == "top_k" and given[name] == 0)}
    SamplingParams(**defaults)  # a bad value fails here, not in every request
    return defaults


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
                          skip_special_tokens=req.skip_special_tokens,
                          ignore_eos=req.ignore_eos, logprobs=logprobs,
                          output_kind=RequestOutputKind.DELTA)
