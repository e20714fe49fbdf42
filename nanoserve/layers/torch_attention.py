"""§5: paged attention in plain torch, twins of flash-attn's two entry points.

Same arguments and semantics as `flash_attn.flash_attn_varlen_func` (with `block_table`) and
`flash_attn.flash_attn_with_kvcache`: gather a request's KV blocks through its block table, run
`scaled_dot_product_attention` (slower than a fused kernel, but exact and portable). Causal
masking follows flash-attn: `lq` queries over `lk >= lq` keys are the request's last `lq` tokens,
so query i sees keys 0 .. lk - lq + i. They also check flash-attn 2's argument contract (cheaply,
no GPU sync), so a CPU test fails on a call the kernel would reject or compute differently;
`flash_contract=True` adds the limits only flash-attn has."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def check_flash_attn_limits(dtype: torch.dtype, head_dim: int, page_size: int | None) -> None:
    """What flash-attn's kernels refuse and the torch twins compute fine."""
    _require(dtype in (torch.float16, torch.bfloat16),
             f"dtype must be float16 or bfloat16 for flash-attn, got {dtype}")
    # % 8: flash-attn would pad (copy) the whole cache on every call.
    _require(head_dim <= 256 and head_dim % 8 == 0,
             f"head_dim must be <= 256 and a multiple of 8 for flash-attn, got {head_dim}")
    _require(page_size is None or page_size % 256 == 0,
             f"block_size must be a multiple of 256 for flash-attn's paged KV, got {page_size}")


def _check_contract(qkv: dict[str, torch.Tensor], index: dict[str, torch.Tensor | None],
                    paged: bool, flash_contract: bool) -> None:
    # if/raise, not _require: its message would be formatted on every call, 30 per step.
    q, k, _ = qkv.values()
    for name, t in qkv.items():
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension")
        if t.dtype != q.dtype:
            raise ValueError(f"{name} has dtype {t.dtype}, q has {q.dtype}: they must match")
    for name, t in index.items():
        if t is not None and t.dtype != torch.int32:
            raise ValueError(f"{name} must be int32, got {t.dtype}")
    if q.shape[-2] % k.shape[-2]:
        raise ValueError(f"num_kv_heads ({k.shape[-2]}) must divide num_heads ({q.shape[-2]})")
    if flash_contract:
        check_flash_attn_limits(q.dtype, q.shape[-1], k.shape[1] if paged else None)


# The engine never sends a query that sees no key (its tests make sure of that).
_NO_KEY = "sequence {}: a query would see no key (flash-attn gives 0, the twin NaN)"


def flash_attn_varlen_func(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
    dropout_p: float = 0.0, softmax_scale: float | None = None, causal: bool = False,
    block_table: torch.Tensor | None = None, flash_contract: bool = False) -> torch.Tensor:
    """q: [total_q, H, D]. k, v: [total_k, Hkv, D], or paged caches
    [num_blocks, block_size, Hkv, D] when `block_table` [batch, max_blocks] is given."""
    _require(dropout_p == 0.0, "the torch twin supports dropout_p=0.0 only (inference)")
    index = {"cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k, "block_table": block_table}
    _check_contract({"q": q, "k": k, "v": v}, index, block_table is not None, flash_contract)
    out = torch.empty_like(q)
    starts_q, starts_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for i in range(len(starts_q) - 1):
        q0, q1 = starts_q[i], starts_q[i + 1]
        len_q, len_k = q1 - q0, starts_k[i + 1] - starts_k[i]
        for name, n, limit in (("max_seqlen_q", len_q, max_seqlen_q),
                               ("max_seqlen_k", len_k, max_seqlen_k)):  # flash-attn drops the rest
            _require(n <= limit, f"{name}={limit} is below sequence {i}'s length {n}")
        _require(not len_q or len_k - (len_q - 1 if causal else 0) >= 1, _NO_KEY.format(i))
        if block_table is None:
            ki, vi = k[starts_k[i]:starts_k[i + 1]], v[starts_k[i]:starts_k[i + 1]]
        else:
            num_blocks = -(-len_k // k.shape[1])  # ceil division
            _require(num_blocks <= block_table.shape[1],
                     f"block_table has too few columns for sequence {i}")
            ids = block_table[i, :num_blocks]  # [n blocks, block_size, Hkv, D] -> [len_k, Hkv, D]
            ki, vi = k[ids].flatten(0, 1)[:len_k], v[ids].flatten(0, 1)[:len_k]
        # [len, H, D] -> [1, H, len, D]: 4-D inputs take the CPU's flash kernel, not the slower
        # math path. enable_gqa: each KV head serves H / Hkv consecutive query heads, uncopied.
        qi, ki, vi = (t.transpose(0, 1)[None] for t in (q[q0:q1], ki, vi))
        mask = None
        if causal and len_q != len_k:
            mask = torch.ones(len_q, len_k, dtype=torch.bool, device=q.device).tril(len_k - len_q)
        o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=softmax_scale,
                                           is_causal=causal and len_q == len_k, enable_gqa=True)
        out[q0:q1] = o[0].transpose(0, 1)
    return out


def check_decode_args(q, k_cache, v_cache, k, v, cache_seqlens, block_table, flash_contract,
                      lengths: bool = True) -> None:
    """flash_attn_with_kvcache's contract; on a CPU the lengths too, unless a kernel checks them."""
    _require(k is None and v is None and block_table is not None and cache_seqlens is not None,
             "the torch twin reads K/V in the cache: pass k=None, v=None, block_table and "
             "cache_seqlens")
    _check_contract({"q": q, "k_cache": k_cache, "v_cache": v_cache},
                    {"cache_seqlens": cache_seqlens, "block_table": block_table}, True,
                    flash_contract)
    batch, head_dim = q.shape[0], q.shape[-1]
    if v_cache.shape != k_cache.shape or k_cache.shape[-1] != head_dim:  # (no f-string per call)
        raise ValueError(f"k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)} "
                         f"and q's head_dim {head_dim} do not match")
    if block_table.shape[0] != batch or cache_seqlens.shape != (batch,):
        raise ValueError(f"block_table and cache_seqlens need one row per query ({batch})")
    if lengths and cache_seqlens.device.type == "cpu":
        lo, hi = cache_seqlens.aminmax()
        if lo < 1:
            raise ValueError(_NO_KEY.format(int(cache_seqlens.argmin())))
        _require(hi <= block_table.shape[1] * k_cache.shape[1],
                 "block_table has too few columns for cache_seqlens")
    if q.shape[1] != 1:
        raise ValueError(f"the torch twin decodes one query per request, got {q.shape[1]}")


def flash_attn_with_kvcache(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    k: torch.Tensor | None = None, v: torch.Tensor | None = None,
    cache_seqlens: torch.Tensor | None = None, block_table: torch.Tensor | None = None,
    softmax_scale: float | None = None, causal: bool = False, flash_contract: bool = False,
) -> torch.Tensor:
    """Decode: q [batch, 1, H, D] attends to the first `cache_seqlens[b]` cached tokens of
    request b, found through `block_table` [batch, max_blocks] in the paged caches. On CUDA,
    unlike flash-attn, it reads every block in the table (masked), so padding must be finite."""
    check_decode_args(q, k_cache, v_cache, k, v, cache_seqlens, block_table, flash_contract)
    batch, _, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    # Each request's blocks, gathered and padded to the table's width: [batch, keys, Hkv, D].
    keys, values = (c[block_table].flatten(1, 2).transpose(1, 2) for c in (k_cache, v_cache))
    # With one query at the last position, causal masking = "only the first L keys".
    visible = torch.arange(keys.shape[2], device=q.device)[None, :] < cache_seqlens[:, None]
    # GQA, no K/V copy: query heads kv_head * group + g become `group` query rows of that KV head.
    q_grouped = q.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(q_grouped, keys, values, attn_mask=visible[:, None, None],
                                         scale=softmax_scale)
    return out.reshape(batch, 1, num_heads, head_dim)  # not view: CUDA SDPA's layout differs
