"""Beam search, nanoserve's `LLM.beam_search` against vLLM's, on the same work: 8 chat prompts
of the bundled model, each searched with `--beam-width` beams for exactly `--max-tokens` tokens
(ignore_eos), twice; the wall time of each search and whether the best sequences are the same.
Both build the search outside their engine, as rounds of one-token requests whose prompt is the
whole sequence, so the KV block size decides how much each round recomputes.

    python scripts/bench/beam_search.py                        # nanoserve, then vLLM
    python scripts/bench/beam_search.py --block-size 32 --dtype bfloat16
    python scripts/bench/beam_search.py --block-size 16 --check-hf       # and HF's sequences
    python scripts/bench/beam_search.py --system nanoserve --model DIR   # one system: JSON

vLLM runs in its own venv and process (.venv-vllm, scripts/bench/setup_vllm_venv.sh); without
it, only nanoserve's line is printed."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
QUESTIONS = ["What is the capital of France?", "Hi!", "Write a haiku about the sea.",
             "List three colors.", "Name a famous painter.", "Explain why the sky is blue.",
             "What is 12 times 12?", "Give me a tip for learning a language."]


def run(system: str, model: str, dtype: str, width: int, tokens: int, block: int | None) -> dict:
    """One system's searches in this process: {"walls": [s, s], "best": [tokens a prompt]}."""
    extra = {} if block is None else {"block_size": block}
    if system == "vllm":
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB, as benchmarks/vllm_worker
        from vllm import LLM
        from vllm.inputs import TokensPrompt as prompt_of
        from vllm.sampling_params import BeamSearchParams

        llm = LLM(model=model, dtype=dtype, max_model_len=2048, seed=0, **extra)
    else:
        sys.path.insert(0, str(ROOT))
        from nanoserve import LLM
        from nanoserve.entrypoints.beam_search import BeamSearchParams

        def prompt_of(prompt_token_ids):
            return {"prompt_token_ids": prompt_token_ids}

        llm = LLM(model, dtype=dtype, max_model_len=2048, **extra)
    tokenizer = llm.get_tokenizer()
    prompts = [prompt_of(prompt_token_ids=tokenizer.apply_chat_template(
        [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
        return_dict=False)) for q in QUESTIONS]
    llm.beam_search(prompts[:1], BeamSearchParams(beam_width=width, max_tokens=2))  # warm-up
    walls = []
    for _ in range(2):
        start = time.perf_counter()
        outputs = llm.beam_search(prompts, BeamSearchParams(beam_width=width, max_tokens=tokens,
                                                            ignore_eos=True))
        walls.append(time.perf_counter() - start)
    return {"walls": walls, "best": [list(o.sequences[0].tokens) for o in outputs]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--system", choices=["nanoserve", "vllm"], help="only this one, as JSON")
    ap.add_argument("--model", help="an HF directory (default: the bundled model)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--beam-width", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--block-size", type=int, help="default: each system's (128 on a CPU)")
    ap.add_argument("--check-hf", action="store_true",
                    help="also HF transformers' search (float32): whose best sequences match")
    args = ap.parse_args()
    if args.model is None:
        sys.path.insert(0, str(ROOT))
        from nanoserve.entrypoints.bundled import default_model_dir

        args.model = default_model_dir()
    setting = (args.model, args.dtype, args.beam_width, args.max_tokens, args.block_size)
    if args.system:
        print(json.dumps(run(args.system, *setting)))
        return
    results = {"nanoserve": run("nanoserve", *setting)}
    vllm_python = ROOT / ".venv-vllm" / "bin" / "python"
    if vllm_python.exists():
        cmd = [str(vllm_python), __file__, "--system", "vllm", "--model", args.model, "--dtype",
               args.dtype, "--beam-width", str(args.beam_width), "--max-tokens",
               str(args.max_tokens)] + ([] if args.block_size is None else
                                        ["--block-size", str(args.block_size)])
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        results["vllm"] = json.loads(next(line for line in reversed(out.splitlines())
                                          if line.startswith('{"walls"')))
    print(f"{len(QUESTIONS)} prompts, beam width {args.beam_width}, {args.max_tokens} tokens, "
          f"{args.dtype}, block size {args.block_size or 'default'}")
    for system, r in results.items():
        print(f"{system:10s} {' / '.join(f'{w:.2f}' for w in r['walls'])} s")
    if "vllm" in results:
        same = sum(a == b for a, b in zip(results["nanoserve"]["best"], results["vllm"]["best"]))
        print(f"best sequences the same: {same}/{len(QUESTIONS)}")
    if args.check_hf:
        hf = hf_best(args.model, results["nanoserve"]["best"], args.beam_width, args.max_tokens)
        for system, r in results.items():
            same = sum(a == b for a, b in zip(hf, r["best"]))
            print(f"{system}'s best the same as HF transformers' num_beams search: "
                  f"{same}/{len(QUESTIONS)}")


def hf_best(model: str, sequences: list[list[int]], width: int, tokens: int) -> list[list[int]]:
    """HF transformers' best sequence for each prompt (the first `len - tokens` ids), float32,
    its EOS ending nothing (as ignore_eos)."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    best = []
    for seq in sequences:
        ids = torch.tensor([seq[:len(seq) - tokens]])
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), num_beams=width,
                              do_sample=False, max_new_tokens=tokens, min_new_tokens=tokens,
                              eos_token_id=hf.config.vocab_size - 1, pad_token_id=0)
        best.append(out[0].tolist())
    return best


if __name__ == "__main__":  # vLLM starts worker processes that re-import this module
    main()
