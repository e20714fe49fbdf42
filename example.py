"""Minimal demo: greedy generation with the bundled SmolLM2 through nanoserve's own model.

(A placeholder until the engine lands: one request, a hand-built AttentionMetadata.)
"""

from __future__ import annotations

import torch
from transformers import AutoTokenizer

from nanoserve.layers.attention import AttentionMetadata, select_backend
from nanoserve.models.loader import load_model
from nanoserve.utils.bundled import default_model_dir

BLOCK_SIZE, NUM_BLOCKS, MAX_NEW_TOKENS = 16, 16, 48


def metadata(start: int, num_new: int) -> AttentionMetadata:
    """One request whose blocks are 0, 1, 2, ... so that cache slot == position."""
    table = torch.arange(NUM_BLOCKS, dtype=torch.int32)[None]
    i32 = dict(dtype=torch.int32)
    decode = num_new == 1
    return AttentionMetadata(
        slot_mapping=torch.arange(start, start + num_new),
        num_decode_tokens=num_new if decode else 0,
        decode_context_lens=torch.tensor([start + 1] if decode else [], **i32),
        decode_block_tables=table if decode else table[:0],
        num_prefill_tokens=0 if decode else num_new,
        cu_seqlens_q=torch.tensor([0] if decode else [0, num_new], **i32),
        cu_seqlens_k=torch.tensor([0] if decode else [0, start + num_new], **i32),
        max_seqlen_q=0 if decode else num_new,
        max_seqlen_k=0 if decode else start + num_new,
        prefill_block_tables=table[:0] if decode else table,
    )


@torch.inference_mode()
def main() -> None:
    model_dir = default_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model, _ = load_model(model_dir, torch.float32, torch.device("cpu"))
    backend = select_backend(torch.device("cpu"))
    for attn in model.attention_layers():
        shape = (NUM_BLOCKS, BLOCK_SIZE, attn.num_kv_heads, attn.head_dim)
        attn.bind(torch.zeros(shape), torch.zeros(shape), backend)

    question = "What is the capital of France?"
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True,
        return_dict=False,
    )
    new_ids, start = list(ids), 0
    answer: list[int] = []
    for _ in range(MAX_NEW_TOKENS):
        positions = torch.arange(start, start + len(new_ids))
        hidden = model(torch.tensor(new_ids), positions, metadata(start, len(new_ids)))
        token = int(model.compute_logits(hidden[-1:]).argmax(-1))
        if token == tokenizer.eos_token_id:
            break
        answer.append(token)
        start, new_ids = start + len(new_ids), [token]
    print(f"Q: {question}\nA: {tokenizer.decode(answer, skip_special_tokens=True)}")


if __name__ == "__main__":
    main()
