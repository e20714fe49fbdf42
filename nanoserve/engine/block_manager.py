"""§5: KV memory as fixed-size blocks, allocated on demand and reclaimed at once: taken from the
free pool as a request's tokens are computed, returned to it in the step the request finishes.

Prefix caching: each *full* block whose KV is computed is registered under a hash chained from its
parent's hash and its token ids, so a hash names a whole prefix (SHA-256, vLLM's since
CVE-2025-25183: no prompt can collide with another's prefix). It stays reusable after it is freed,
until the pool needs it back.

As vLLM's `BlockPool.free_blocks`: a request's blocks are freed tail first; those without a hash,
never reusable, go to the front of the free pool as one run (taken first, the tail first) and
cached ones to the back, so cached prefixes survive longest and a prefix's head outlives its tail.
As vLLM's `PrefixCacheStats`: a resumed request's lookup is counted apart (`preempted_queries`,
`preempted_hits`), because it mostly finds its own recomputed prefix and would inflate the hit
rate of first admissions.

Invariants (checked by the property tests after every step):
    num_free_blocks + num_used_blocks == num_blocks
    ref_count >= 0; a block is in the free pool exactly when its ref_count is 0
    a block with ref_count > 1 is a shared, cached, full prefix block"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from nanoserve.engine.request import Request


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None  # set once the block is full and its KV computed


def hash_block(parent_hash: bytes | None, token_ids: Sequence[int]) -> bytes:
    return hashlib.sha256((parent_hash or b"") + array("q", token_ids).tobytes()).digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free pool in eviction order (front first): freed blocks with a cached prefix join the back
        # (least recently freed leaves first), others the front. OrderedDict: O(1) removal by id.
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached_blocks: dict[int, int] = {}  # block_hash -> block_id
        self.prefix_cache_queries, self.prefix_cache_hits = 0, 0  # tokens looked up, tokens found
        self.preempted_queries, self.preempted_hits = 0, 0  # the same, for resumptions

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)  # ceil division

    def get_computed_blocks(self, req: Request) -> tuple[list[int], int]:
        """Longest cached prefix of a waiting `req`: its blocks and the tokens they cover. The last
        token is never taken from the cache: even a fully cached prompt computes its logits."""
        if not self.enable_prefix_caching:
            return [], 0
        bs = self.block_size
        num_full = (req.num_tokens - 1) // bs
        hits: list[int] = []
        parent: bytes | None = None
        for i in range(num_full):
            parent = hash_block(parent, req.token_ids[i * bs:(i + 1) * bs])
            block_id = self.cached_blocks.get(parent)
            if block_id is None:
                break
            hits.append(block_id)
        return hits, len(hits) * self.block_size

    def allocate_slots(self, req: Request, num_new_tokens: int,
                       new_computed_blocks: list[int] | None = None,
                       full_sequence_must_fit: bool = False) -> bool:
        """Give `req` blocks for `num_new_tokens` more tokens; at admission, `new_computed_blocks`
        (from get_computed_blocks, maybe []) join first. All or nothing: False changes no state.
        `full_sequence_must_fit`: fail unless the blocks of all `req.num_tokens` fit too."""
        computed = new_computed_blocks or []
        # Cached blocks only come at admission, when num_computed_tokens is still 0.
        total = req.num_computed_tokens + len(computed) * self.block_size + num_new_tokens
        held = len(req.block_table) + len(computed)
        num_new_blocks = self.blocks_needed(total) - held
        # total <= num_tokens: room for the whole sequence is room for this chunk too.
        needed = self.blocks_needed(req.num_tokens) - held if full_sequence_must_fit \
            else num_new_blocks
        # Cached blocks in the free pool are about to leave it, so they are not room for new ones.
        num_revived = sum(1 for b in computed if self.blocks[b].ref_count == 0)
        if needed > self.num_free_blocks - num_revived:
            return False
        if new_computed_blocks is not None and self.enable_prefix_caching:
            # Counted at admission only: a request waiting for room is looked up every step.
            hits = len(computed) * self.block_size
            if req.num_preemptions:
                self.preempted_queries += req.num_tokens
                self.preempted_hits += hits
            else:
                self.prefix_cache_queries += req.num_tokens
                self.prefix_cache_hits += hits
        for block_id in computed:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_blocks[block_id]
            block.ref_count += 1
            req.block_table.append(block_id)
            req.block_hashes.append(block.block_hash)
        for _ in range(num_new_blocks):
            req.block_table.append(self._take_free_block())
        return True

    def _take_free_block(self) -> int:
        block_id, _ = self.free_blocks.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:  # evict: its prefix is no longer reusable
            if self.cached_blocks.get(block.block_hash) == block_id:
                del self.cached_blocks[block.block_hash]
            block.block_hash = None
        block.ref_count = 1
        return block_id

    def cache_full_blocks(self, req: Request) -> None:
        """Register the blocks that became full *and computed* this step. Called after the
        forward pass, never before: a hash must not promise KV that was never written."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        num_full = req.num_computed_tokens // bs
        parent = req.block_hashes[-1] if req.block_hashes else None
        for i in range(len(req.block_hashes), num_full):
            parent = hash_block(parent, req.token_ids[i * bs:(i + 1) * bs])
            req.block_hashes.append(parent)
            block = self.blocks[req.block_table[i]]
            if block.block_hash is None:
                block.block_hash = parent
                # First writer wins; an equal block computed twice just isn't shared.
                self.cached_blocks.setdefault(parent, block.block_id)

    def free(self, req: Request) -> None:
        """Return all of `req`'s blocks, tail first: its shared prefix is then evicted last, and
        its blocks without a hash go to the front as one run, its tail first (taken first)."""
        unhashed = []
        for block_id in reversed(req.block_table):
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise RuntimeError(f"block {block_id} freed with ref_count {block.ref_count}")
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_blocks[block_id] = None  # back of the pool
                if block.block_hash is None:
                    unhashed.append(block_id)
        for block_id in reversed(unhashed):  # the run's last block first, so its first leads
            self.free_blocks.move_to_end(block_id, last=False)
        req.block_table, req.block_hashes = [], []

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Over first admissions only: a resumption's hits are its own recompute, not reuse."""
        return self.prefix_cache_hits / max(self.prefix_cache_queries, 1)
