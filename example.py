"""Offline generation with nanoserve: several chat prompts of different lengths, batched
continuously. Run `python example.py --trace` to see one line per engine step: requests
joining mid-batch, prefill chunks sharing steps with decodes, and requests leaving as
soon as they finish (chapter §3–§4). `--trace-file run.jsonl` records the same steps;
`python scripts/reader/trace_page.py run.jsonl` turns them into a page to explore."""

from __future__ import annotations

import argparse

from nanoserve import LLM, SamplingParams

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Hi!",
    "Explain, in a short paragraph a ten-year-old would understand, why we have day and night.",
    "Give me three tips for writing clean Python code.",
    "What is 7 times 8?",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="HF-style model directory "
                        "(default: the bundled SmolLM2-135M-Instruct)")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--trace", action="store_true", help="print one line per step")
    parser.add_argument("--trace-file", default=None, help="write every step as JSON lines "
                        "(overwritten); view it: python scripts/reader/trace_page.py FILE")
    args = parser.parse_args()
    if args.trace_file:
        open(args.trace_file, "w").close()  # the engine appends; start this run afresh

    # Small max_num_seqs and token budget so the trace shows requests waiting, joining
    # mid-batch and prefills being chunked, and 16-token KV blocks (a CPU's default is vLLM's
    # 128) so that blocks come and go every few steps and the chat template's shared system
    # prompt fills one, a prefix-cache hit. The answers are the same with any settings.
    llm = LLM(args.model, max_num_seqs=4, max_num_batched_tokens=64, block_size=16,
              trace=args.trace)
    if args.trace_file:
        llm.trace_to(args.trace_file, source="example")
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    # chat(): each conversation through the model's chat template, then generate()
    outputs = llm.chat(conversations, params, use_tqdm=not args.trace)  # bar and trace clash
    for question, out in zip(QUESTIONS, outputs):
        m = out.metrics
        print(f"\n### {question}\n{out.text.strip()}")
        print(f"[{len(out.token_ids)} tokens, finish: {out.finish_reason}, "
              f"TTFT {m.ttft * 1000:.0f} ms, E2E {m.e2e:.2f} s]")
    print(f"\n{llm.stats()}")


if __name__ == "__main__":
    main()
