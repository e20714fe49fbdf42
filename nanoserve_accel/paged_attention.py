"""§5 on a CPU, fast: decode attention that reads the paged KV cache in place (csrc/attention.c).
The torch twin gathers a copy of every decoding request's blocks in every layer, which at large
batches costs more than the attention itself; this kernel reads each cached K/V row once, where it
lies, one request per task, with the twin's signature and checks; on CPUs with AVX-512 its loop
nest for head sizes 64 and 128 is csrc/attention_avx512.c (AVX512-BF16's dot products on bf16
caches), which measured ~1.3x attention.c's 8-lane one there. Prefill chunks in bf16 on
AVX512-BF16 CPUs, and in fp32 on AVX-512F ones: csrc/attention_prefill.c, every request of the
chunk in one call, in place; elsewhere the twin. The cache write is one C copy, where
index_copy_ pays torch's per-call cost in every layer."""

from __future__ import annotations

import ctypes
import dataclasses

import torch

from nanoserve.layers import torch_attention
from nanoserve.layers.attention import AttentionBackend
from nanoserve_accel import plan
from nanoserve_accel.fused import KERNEL_DTYPES


def with_decode_kernel(backend: AttentionBackend, lib: ctypes.CDLL) -> AttentionBackend:
    def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None,
                                block_table=None, softmax_scale=None, causal=False,
                                flash_contract=False):
        tensors = (q, k_cache, v_cache, block_table, cache_seqlens)
        if (q.dtype not in KERNEL_DTYPES or q.shape[-1] % 8  # the kernel reads 8 lanes at a time
                or not all(t is not None and t.is_contiguous() for t in tensors)):
            return backend.with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, block_table,
                                        softmax_scale, causal, flash_contract)
        # The twin's checks of the shapes; the kernel checks the lengths and block ids itself,
        # where they cost a loop, not 2 reductions and their reads back in every layer.
        args = (q, k_cache, v_cache, k, v, cache_seqlens, block_table, flash_contract)
        torch_attention.check_decode_args(*args, lengths=False)
        batch, _, num_heads, head_dim = q.shape
        num_blocks, block_size, num_kv_heads, _ = k_cache.shape
        out = torch.empty_like(q)
        scale = softmax_scale if softmax_scale is not None else head_dim**-0.5
        bad = lib.paged_decode(
            q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_table.data_ptr(),
            cache_seqlens.data_ptr(), out.data_ptr(), batch, num_heads, num_kv_heads, head_dim,
            block_size, block_table.shape[1], num_blocks, scale, q.dtype == torch.bfloat16,
            None, 0)
        if bad >= 0:  # nothing was read: the twin's check names a bad length, else a block id
            torch_attention.check_decode_args(*args)
            raise ValueError(f"block_table row {bad} holds block ids outside [0, {num_blocks})")
        return out

    def store_kvcache(key, value, k_cache, v_cache, slot_mapping) -> None:
        tensors = (key, value, k_cache, v_cache, slot_mapping)
        num_slots = k_cache.shape[0] * k_cache.shape[1]
        if (key.shape != value.shape or key.shape[1:] != k_cache.shape[2:]
                or v_cache.shape != k_cache.shape or slot_mapping.shape != key.shape[:1]
                or slot_mapping.dtype != torch.int64 or len({t.dtype for t in tensors[:4]}) > 1
                or not all(t.is_contiguous() for t in tensors)):
            return backend.store_kvcache(*tensors)  # index_copy_ copes, or says what is wrong
        row = k_cache.stride(1) * k_cache.element_size()  # bytes: one token's K, all KV heads
        if (bad := lib.store_kv(*(t.data_ptr() for t in tensors), len(key), row, num_slots)) >= 0:
            raise ValueError(f"slot_mapping[{bad}] = {int(slot_mapping[bad])} is outside the "
                             f"cache's slots [0, {num_slots})")

    return dataclasses.replace(backend, name=f"{backend.name}+cpu-decode",
                               with_kvcache=flash_attn_with_kvcache, store_kvcache=store_kvcache)


def with_prefill_kernel(backend: AttentionBackend, lib: ctypes.CDLL,
                        machine: plan.Machine) -> AttentionBackend:
    """Prefill chunks through csrc/attention_prefill.c (bf16 caches on AVX512-BF16 CPUs, fp32 on
    AVX-512F ones; head sizes 64 and 128, causal, paged: what the engine sends); anything else,
    or anything the kernel finds out of range, goes to the twin, which computes it or names what
    is wrong. On CPUs with AMX the bf16 path multiplies on the tiles."""
    amx = int(plan.prefill_attention(machine, torch.bfloat16) == "C, AMX tiles")
    dtypes = {d for d in (torch.float32, torch.bfloat16)
              if plan.prefill_attention(machine, d) != "torch twin"}

    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               dropout_p=0.0, softmax_scale=None, causal=False,
                               block_table=None, flash_contract=False):
        args = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                softmax_scale, causal, block_table, flash_contract)
        index = (cu_seqlens_q, cu_seqlens_k, block_table)
        if (not causal or dropout_p != 0.0 or flash_contract or block_table is None
                or q.dtype not in dtypes or q.dim() != 3 or q.shape[-1] not in (64, 128)
                or k.dim() != 4 or k.dtype != q.dtype or v.dtype != q.dtype
                or v.shape != k.shape or k.shape[-1] != q.shape[-1]
                or any(t.dtype != torch.int32 or not t.is_contiguous() for t in index)
                or cu_seqlens_k.shape != cu_seqlens_q.shape or cu_seqlens_q.dim() != 1
                or block_table.dim() != 2 or block_table.shape[0] != len(cu_seqlens_q) - 1
                or not (q.is_contiguous() and k.is_contiguous() and v.is_contiguous())):
            return backend.varlen_func(*args)
        num_blocks, block_size, num_kv_heads, head_dim = k.shape
        out = torch.empty_like(q)
        scale = softmax_scale if softmax_scale is not None else head_dim**-0.5
        bad = lib.paged_prefill(
            q.data_ptr(), k.data_ptr(), v.data_ptr(), cu_seqlens_q.data_ptr(),
            cu_seqlens_k.data_ptr(), block_table.data_ptr(), out.data_ptr(),
            len(cu_seqlens_q) - 1, q.shape[0], q.shape[1], num_kv_heads, head_dim, block_size,
            block_table.shape[1], num_blocks, max_seqlen_q, max_seqlen_k, scale,
            int(q.dtype == torch.bfloat16), amx)
        if bad == -2:
            raise MemoryError("prefill attention: no memory for its work space")
        return out if bad == -1 else backend.varlen_func(*args)

    return dataclasses.replace(backend, name=f"{backend.name}+cpu-prefill",
                               varlen_func=flash_attn_varlen_func)
