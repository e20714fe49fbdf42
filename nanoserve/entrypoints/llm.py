"""The offline entry point (vLLM's `LLM`): text in, text out, around the chapter's loop
(engine/llm_engine.py). `add_request` queues a prompt's Requests (input_processor.py checks and
tokenizes it); `step()` is one turn of the loop, its outputs detokenized (a stop string ends its
request, in the scheduler's stop check); `n` completions of one prompt are child requests
gathered under its id (parallel_sampling.py); `generate()` is just "add every prompt, then step
until nothing is left"."""

from __future__ import annotations

import atexit
import dataclasses
import gc
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch
from huggingface_hub import snapshot_download
from tqdm import tqdm
from transformers import AutoTokenizer

from nanoserve.config import EngineConfig, flash_attn_missing
from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.engine.request import FinishReason, Request, RequestStatus
from nanoserve.entrypoints.beam_search import BeamSearchOutput, BeamSearchParams, beam_search
from nanoserve.entrypoints.bundled import default_model_dir
from nanoserve.entrypoints.cpu_share import CoreShare
from nanoserve.entrypoints.detokenizer import Detokenizer
from nanoserve.entrypoints.generation_config import sampling_defaults
from nanoserve.entrypoints.input_processor import InputProcessor
from nanoserve.entrypoints.outputs import RequestOutput, request_output
from nanoserve.entrypoints.parallel_sampling import ParentRequest
from nanoserve.entrypoints.prompts import Prompt, chat_prompts
from nanoserve.sampling_params import RequestOutputKind, SamplingParams

# A process that imported the engine ends without the interpreter's final garbage collections
# walking its heap (torch's, the tokenizer's, a KV block an object): 1-5 s of a server's or a
# script's exit on a small CPU, for nothing that has to run.
atexit.register(gc.freeze)

# vLLM's other spellings of nanoserve's settings (EngineArgs): its dtype names, a torch dtype
VLLM_DTYPES = {"half": "float16", "float": "float32", torch.float16: "float16",
               torch.bfloat16: "bfloat16", torch.float32: "float32"}


def vllm_spellings(config: dict) -> dict:
    """`config` with vLLM's spellings in nanoserve's: dtype "half" / "float" / a torch dtype,
    kv_cache_memory_bytes (the pool in bytes, "4G" on the command line), and
    long_prefill_token_threshold 0 (vLLM's "off"); trust_remote_code is a no-op (as served):
    no model code runs but nanoserve's own."""
    config = dict(config)
    if isinstance(config.get("trust_remote_code"), bool):
        del config["trust_remote_code"]
    if isinstance(dtype := config.get("dtype"), (str, torch.dtype)):
        config["dtype"] = VLLM_DTYPES.get(dtype, dtype)
    if "kv_cache_memory_bytes" in config:
        if "kv_cache_memory_gib" in config:
            raise ValueError("kv_cache_memory_bytes must be None with kv_cache_memory_gib")
        size = config.pop("kv_cache_memory_bytes")
        if not (isinstance(size, int) and not isinstance(size, bool) and size > 0):
            raise ValueError(f"kv_cache_memory_bytes must be an integer > 0, got {size!r}")
        config["kv_cache_memory_gib"] = size / 2**30
    if type(config.get("long_prefill_token_threshold")) is int and \
            config["long_prefill_token_threshold"] == 0:
        config["long_prefill_token_threshold"] = None
    return config


def cached_snapshot(model: object) -> str:
    """A hub id ("org/name", as vLLM takes it) is its snapshot in the local Hugging Face cache,
    where one is: nothing is downloaded."""
    try:
        return snapshot_download(model, local_files_only=True)
    except Exception:  # not an id, or not cached
        raise ValueError(f"model must be None (the bundled model), a local model directory or "
                         f"a hub id already in the local cache (nothing is downloaded), got "
                         f"{model!r}") from None


class LLM(LLMEngine):
    """`LLM(model=None, tokenizer=None, generation_config="auto", override_generation_config=None,
    **config)`; model: a model folder, a hub id in the local cache, or None (the bundled
    SmolLM2); tokenizer: a folder to load it from, not the model's; generation_config: whose
    sampling defaults apply, and override_generation_config settings over them (vLLM's all;
    generation_config.py); config: EngineConfig's settings, some in vLLM's spellings too."""

    def __init__(self, model: str | None = None, *, tokenizer: str | None = None,
                 generation_config: str = "auto", override_generation_config: dict | None = None,
                 **config: object) -> None:
        known, config = [f.name for f in dataclasses.fields(EngineConfig)], vllm_spellings(config)
        if unknown := [name for name in config if name not in known]:  # (vLLM's others)
            raise ValueError(f"{unknown[0]} is not a nanoserve setting; the settings are "
                             f"{', '.join(known)}, tokenizer, generation_config, "
                             f"override_generation_config")
        if tokenizer is not None and not (isinstance(tokenizer, str)
                                          and os.path.isdir(tokenizer)):
            raise ValueError(f"tokenizer must be None or a directory holding a tokenizer, got "
                             f"{tokenizer!r}")
        if model is not None and not (isinstance(model, (str, os.PathLike))
                                      and os.path.isdir(model)):  # as vLLM reads a hub's id
            model = cached_snapshot(model)
        model = os.fspath(model) if model is not None else default_model_dir()
        self.sampling_defaults = sampling_defaults(  # before the load
            generation_config, model, override_generation_config)
        super().__init__(model, EngineConfig(**config))
        self.tokenizer = None if self.config.skip_tokenizer_init else \
            AutoTokenizer.from_pretrained(tokenizer or self.model_dir)  # None: prompts are ids
        self.processor = InputProcessor(self, self.tokenizer)  # prompt -> Requests, checked
        self.scheduler.stop_string_in = self._stop_string_in
        self._pending: list[RequestOutput] = []  # aborted or stray: the next step() returns them
        self._detokenizers: dict[str, Detokenizer] = {}  # of every unfinished request
        self._parents: dict[str, ParentRequest] = {}  # n > 1: parent id and child ids -> parent
        # On a CPU the team follows the cores other processes leave (cpu_share.py).
        self.core_share = CoreShare.probe() if self.config.device == "cpu" and \
            self.config.tensor_parallel_size == 1 else None
        print(f"nanoserve: {self.describe()}", file=sys.stderr)

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: SamplingParams with the model's recommended defaults (generation_config.py),
        what generate() and add_request() use without sampling params."""
        return SamplingParams(**self.sampling_defaults)

    def get_tokenizer(self) -> Any:
        """The model's HF tokenizer (vLLM's LLM.get_tokenizer); None with skip_tokenizer_init."""
        return self.tokenizer

    def add_request(self, prompt: Prompt, sampling_params: SamplingParams | None = None,
                    priority: int = 0) -> str:
        """Queue one request (a str or token ids); returns its request_id."""
        return self._add(self.processor.make_requests(
            prompt, sampling_params or self.get_default_sampling_params(), priority))

    def _add(self, reqs: list[Request]) -> str:
        for req in reqs:
            self._detokenizers[req.request_id] = Detokenizer(self.tokenizer, req.sampling_params)
        if len(reqs) == 1:
            self.scheduler.add_request(reqs[0])
            return reqs[0].request_id
        parent_id = reqs[0].request_id.partition("_")[2]
        held = reqs[1:] if self.config.enable_prefix_caching else []
        parent = ParentRequest(parent_id, reqs, held)
        self._parents.update({r.request_id: parent for r in [*reqs, parent]})
        for req in reqs[:len(reqs) - len(held)]:
            self.scheduler.add_request(req)
        return parent_id

    def abort(self, request_id: str) -> bool:
        """Abort a waiting, running or preempted request; its output (finish_reason
        "abort") comes from the next step(). Unknown or finished ids: no-op, False."""
        if not isinstance(request_id, str):  # abort(3) would silently miss request "3"
            raise ValueError(f"request_id must be a str (the id add_request returned), "
                             f"got {type(request_id).__name__} {request_id!r}")
        parent = self._parents.get(request_id)
        if parent is None or parent.request_id != request_id:
            aborted = [self.abort_request(request_id)]
        else:
            aborted = [self.abort_request(c.request_id) for c in parent.children
                       if c not in parent.held]
            for req in parent.held:  # never scheduled: it ends here
                req.status, req.finish_reason = RequestStatus.FINISHED, FinishReason.ABORT
                aborted.append(req)
            parent.held = []
        self._pending += self._gather([self._output(r) for r in aborted if r is not None])
        return any(r is not None for r in aborted)

    def has_unfinished_requests(self) -> bool:
        return (super().has_unfinished_requests() or bool(self._pending)
                or any(p.held for p in self._parents.values()))

    def step(self) -> list[RequestOutput]:
        """One turn of the loop (§4): outputs of requests that finished (or were aborted), and
        DELTA outputs of running ones that asked for them (SamplingParams.output_kind)."""
        if self.core_share is not None:
            self.core_share.update()
        finished = super().step()
        deltas = []
        for entry in self.last_scheduler_output.scheduled:  # the DELTAs' text
            req = entry.request
            if entry.samples and (d := self._detokenizers[req.request_id]).delta:
                d.update(req)
                if not req.is_finished:
                    deltas.append(req)
        for parent in {id(p): p for p in self._parents.values()}.values():
            for req in parent.release():  # child 0 computed the prompt: its blocks are cached
                self.scheduler.add_request(req)
        outputs, self._pending = self._pending, []
        return outputs + self._gather([self._output(r) for r in deltas + finished])

    def _stop_string_in(self, req: Request) -> bool:
        """The scheduler's stop check asks: the new tokens' text completes a stop string."""
        return self._detokenizers[req.request_id].update(req) is not None

    def _gather(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """n > 1: each child's output as its parent's (parallel_sampling.py)."""
        gathered = []
        for output in outputs:
            if (parent := self._parents.get(output.request_id)) is None:
                gathered.append(output)
                continue
            delta = parent.children[0].sampling_params.output_kind == RequestOutputKind.DELTA
            if (mine := parent.gather(output, delta)) is not None:
                gathered.append(mine)
            if mine is not None and mine.finished:
                for key in [parent.request_id, *(c.request_id for c in parent.children)]:
                    del self._parents[key]
        return gathered

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: int | Sequence[int] | None = None,
                 ) -> list[RequestOutput]:
        """Generate for all prompts; outputs come back in input order. Outputs of requests
        added earlier with add_request() that finish meanwhile are kept for the next step().
        `priority`: one for all or one a prompt (vLLM's; policy "priority": smaller first, §6.1)."""
        requests = self.processor.make_batch(prompts, sampling_params, priority,
                                             self.get_default_sampling_params())
        mine = []
        for reqs in requests:  # all validated: only now does engine state change
            for req in reqs:
                req.sampling_params.output_kind = RequestOutputKind.FINAL_ONLY  # one output each
            mine.append(self._add(reqs))
        results: dict[str, RequestOutput] = {}
        strays: list[RequestOutput] = []
        bar = tqdm(total=len(mine), desc="Generating", disable=not use_tqdm, dynamic_ncols=True)
        start, num_tokens = time.perf_counter(), 0
        try:
            while len(results) < len(mine):
                for output in self.step():
                    if output.request_id in mine:
                        results[output.request_id] = output
                        bar.update(1)
                    else:
                        strays.append(output)
                num_tokens += self.last_scheduler_output.num_scheduled_tokens
                bar.set_postfix_str(f"{num_tokens / (time.perf_counter() - start):.0f} tok/s")
        except BaseException:
            for req in (r for reqs in requests for r in reqs):  # leave nothing holding KV
                self.scheduler.finish_request(req.request_id, FinishReason.ABORT,
                                              drop_finished=True)
                self._detokenizers.pop(req.request_id, None)
                self._parents.pop(req.request_id, None)
            for request_id in mine:
                self._parents.pop(request_id, None)
            raise
        finally:
            bar.close()
            self._pending += strays
        return [results[request_id] for request_id in mine]

    def chat(self, messages: list[dict] | Sequence[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             continue_final_message: bool = False, chat_template_kwargs: dict | None = None,
             chat_template: str | None = None, tools: list[dict] | None = None
             ) -> list[RequestOutput]:
        """generate() on conversations (vLLM's LLM.chat): `messages` is one conversation,
        [{"role": ..., "content": ...}, ...], or a list of them, each rendered by the model's
        chat template (or `chat_template`, a Jinja template), `tools` shown by it; one output a
        conversation, in order (a tool call stays text: the server reads them)."""
        prompts = chat_prompts(messages, self.tokenizer, add_generation_prompt,
                               continue_final_message, chat_template_kwargs, chat_template, tools)
        return self.generate(prompts, sampling_params, use_tqdm)

    def beam_search(self, prompts: Sequence[Prompt], params: BeamSearchParams
                    ) -> list[BeamSearchOutput]:
        """vLLM's: each prompt's `params.beam_width` best sequences (beam_search.py)."""
        return beam_search(self, prompts, params)

    def _output(self, req: Request) -> RequestOutput:
        d = (self._detokenizers.pop if req.is_finished else self._detokenizers.get)(req.request_id)
        return request_output(req, d)

    def shutdown(self) -> None:
        """Also gives the process back the CPU team and the cores it started with."""
        if self.core_share is not None:
            self.core_share.release()
        super().shutdown()

    def describe(self) -> str:
        """What runs: the start-up line (also printed by LLM())."""
        c, r = self.config, self.model_runner
        graphs = c.device.startswith("cuda") and not c.enforce_eager
        why = "its paged kernels" if c.attention_backend == "flash-attn" else \
            flash_attn_missing(torch.device(c.device), r.dtype) or "asked for"
        return (f"{c.device}, {c.dtype}, attention {c.attention_backend} ({why}), block size "
                f"{c.block_size}, {r.num_kv_blocks} KV blocks ({r.kv_cache_bytes / 2**30:.2f} "
                f"GiB), weights {r.weight_bytes / 2**30:.2f} GiB, max_num_seqs "
                f"{c.max_num_seqs}, max_num_batched_tokens {c.max_num_batched_tokens}, CUDA "
                f"graphs {'on' if graphs else 'off'}, torch.compile "
                f"{'on' if c.torch_compile else 'off'}, fast paths "
                f"{', '.join(r.fast_paths) or 'none'}{self._cache_caps_requests()}")

    def _cache_caps_requests(self) -> str:
        """Where the whole KV cache holds fewer tokens than max_model_len, what that means (vLLM
        refuses to start; here a request stops there, finish_reason "length"), else ""."""
        held = self.scheduler.max_model_len_in_cache  # the cap the scheduler applies
        if held == self.config.max_model_len:
            return ""
        return (f"; the KV cache holds {held} tokens, fewer than max_model_len "
                f"{self.config.max_model_len}: a request stops there (finish_reason 'length')")
