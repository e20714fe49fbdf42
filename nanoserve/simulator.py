"""§5 without a model: a stand-in runner whose next token depends on the KV it reads.

`KVReadingRunner` runs a step the way the ModelRunner does, through the real, pure
`prepare_inputs`, but its "KV cache" holds token ids: every new token's id is written at its
slot (`slot_mapping`), and every sampling row reads its context back through its block
table, position by position, up to its context length. The next token is a hash of what it
read. So a wrong slot, a stale or wrongly shared block, or a prefix-cache hit on KV that was
never computed changes the output (or raises, for a slot never written), while a correct
engine gives every request `next_token(its own tokens)`, whatever it was batched with.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from nanoserve.engine.model_runner import prepare_inputs
from nanoserve.engine.scheduler import SchedulerOutput


def next_token(token_ids: Sequence[int], vocab_size: int = 1000) -> int:
    """An order-sensitive hash of a sequence, in [0, vocab_size - 1): the id vocab_size - 1
    is never produced, so it can serve as an EOS that only max_tokens reaches."""
    h = 0
    for t in token_ids:
        h = (h * 1_000_003 + t + 1) % (2**61 - 1)
    return h % (vocab_size - 1)


class KVReadingRunner:
    def __init__(self, num_blocks: int, block_size: int, vocab_size: int = 1000) -> None:
        self.block_size, self.vocab_size = block_size, vocab_size
        self.kv: list[int | None] = [None] * (num_blocks * block_size)  # token id per slot

    def execute_model(self, out: SchedulerOutput) -> dict[str, int]:
        inputs = prepare_inputs(out, self.block_size, torch.device("cpu"))
        meta, bs = inputs.attn_metadata, self.block_size
        positions = inputs.positions.tolist()
        for slot, token in zip(meta.slot_mapping.tolist(), inputs.input_ids.tolist()):
            self.kv[slot] = token
        cu_q, cu_k = meta.cu_seqlens_q.tolist(), meta.cu_seqlens_k.tolist()
        sampled = {}
        for row, req in zip(inputs.sample_indices, inputs.sample_requests):
            if row < meta.num_decode_tokens:  # a decode row reads its whole context
                table = meta.decode_block_tables[row].tolist()
                context_len = int(meta.decode_context_lens[row])
            else:  # a prefill row sees the chunk's keys up to itself (causal)
                q = row - meta.num_decode_tokens
                j = next(j for j in range(len(cu_q) - 1) if q < cu_q[j + 1])
                table = meta.prefill_block_tables[j].tolist()
                context_len = cu_k[j + 1] - cu_k[j] - (cu_q[j + 1] - q) + 1
            if positions[row] != context_len - 1:
                raise RuntimeError(f"{req.request_id}: position {positions[row]} but "
                                     f"context length {context_len}")
            read = [self.kv[table[p // bs] * bs + p % bs] for p in range(context_len)]
            if None in read:
                raise RuntimeError(f"{req.request_id} read a KV slot never written "
                                     f"(position {read.index(None)})")
            sampled[req.request_id] = next_token(read, self.vocab_size)
        return sampled
