"""§4 on a CPU, fewer calls: a decoder layer of a decode step as one C call (csrc/layer.c), where
the modules make about a dozen (norms, GEMMs, RoPE, cache write, attention, residual adds), each
paying Python's dispatch, ctypes' argument conversion and an output allocation: at one row that
overhead was about a tenth of the step. The C calls the same kernels in the same order, so it
computes the same values. It runs only where it can (every row decodes one token, and each of
the layer's linears takes a C GEMM at that row count); otherwise the modules run as before.
It replaces each DecoderLayer, after replace_linears and fuse_elementwise; where it replaced
them all, the DecoderModel runs them, with the embedding and the final norm, in one C call a
step (FusedDecoderModel)."""

from __future__ import annotations

import ctypes

import torch
from torch import nn

from nanoserve.layers.attention import AttentionMetadata
from nanoserve.models.decoder import DecoderLayer, DecoderModel
from nanoserve_accel.fused import FusedAttention, FusedRMSNorm, FusedSiluAndMul, padded
from nanoserve_accel.linear import CLinear
from nanoserve_accel.plan import GEMM_KINDS

_P, _I, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_float


class Gemm(ctypes.Structure):
    _fields_ = [("w", _P), ("bias", _P), ("kind", _I), ("n", _I), ("k", _I)]


class LayerArgs(ctypes.Structure):
    """csrc/layer.c's `struct layer`."""

    _fields_ = [("input_norm", _P), ("post_norm", _P), ("qkv", Gemm), ("o", Gemm),
                ("gate_up", Gemm), ("down", Gemm), ("k_cache", _P), ("v_cache", _P),
                *((name, _I) for name in ("hidden", "H", "Hkv", "D", "I", "block_size",
                                          "num_blocks", "bf16")),
                ("eps", _F), ("scale", _F)]


def gemm_args(linear: nn.Module) -> tuple[Gemm, int] | None:
    """The C GEMM `linear` takes and up to how many rows (None: it never takes one)."""
    if not isinstance(linear, CLinear):
        return None
    rows = linear.max_rows if linear.max_rows is not None else 1 << 30
    return Gemm(linear.w_ptr, linear.bias_ptr, GEMM_KINDS[linear.kernel], linear.n,
                linear.k), rows


class FusedDecoderLayer(nn.Module):
    """DecoderLayer.forward as one C call where it can; `plain` (the decoder's layer, with its
    fused modules) everywhere else."""

    def __init__(self, plain: DecoderLayer, lib: ctypes.CDLL, args: LayerArgs,
                 dtype: torch.dtype, max_rows: int) -> None:
        super().__init__()
        self.plain, self.lib, self.args, self.dtype = plain, lib, args, dtype
        self.max_rows = max_rows  # the most decode rows all four GEMMs take in C
        self.attn = plain.self_attn.plain.attn

    def takes(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              meta: AttentionMetadata, max_rows: int) -> bool:
        """Whether the C runs this step: decode rows only, at most max_rows, as it lays them out."""
        return not (x.dtype != self.dtype or cos.dtype != x.dtype or sin.dtype != x.dtype
                    or not all(t.is_contiguous() for t in (x, cos, sin))
                    or not self.takes_step(x.shape[0], meta, max_rows))

    def takes_step(self, n: int, meta: AttentionMetadata, max_rows: int) -> bool:
        """takes()'s checks of the step's n rows and metadata (decode_model makes x, cos, sin)."""
        cache = self.attn.k_cache
        tables, lens, slots = meta.decode_block_tables, meta.decode_context_lens, meta.slot_mapping
        return not (meta.num_decode_tokens != n or n > max_rows  # prefill rows: the modules
                    or cache.dtype != self.dtype or tables.dtype != torch.int32
                    or lens.dtype != torch.int32 or slots.dtype != torch.int64
                    or tables.shape[0] != n or lens.shape != (n,) or slots.shape != (n,)
                    or cache.dim() != 4
                    or not all(t.is_contiguous() for t in (tables, lens, slots)))

    def bind_cache(self) -> None:
        """The cache's fields of `args`, from the attention's cache as bound now."""
        cache, args = self.attn.k_cache, self.args
        args.k_cache, args.v_cache = cache.data_ptr(), self.attn.v_cache.data_ptr()
        args.num_blocks, args.block_size = cache.shape[0], cache.shape[1]

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        if not self.takes(x, cos, sin, meta, self.max_rows):
            return self.modules(x, cos, sin, meta)
        self.bind_cache()
        out = torch.empty_like(x)
        bad = self.lib.decode_layer(ctypes.addressof(self.args), x.data_ptr(), out.data_ptr(),
                                    *step_pointers(cos, sin, meta))
        return out if check(bad) else self.modules(x, cos, sin, meta)

    def modules(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """DecoderLayer.forward through its modules (prefill steps), its residual adds in C, the
        first in the pass of the norm after it (as vLLM's fused_add_rms_norm): the same values.
        torch's bf16 add of a 390-token step took ~90 us a call on one thread."""
        plain, lib = self.plain, self.lib
        if x.dtype != self.dtype or x.dim() != 2 or not x.is_contiguous():
            return plain(x, cos, sin, meta)
        norm, bf16 = plain.post_attention_layernorm, self.dtype == torch.bfloat16
        h = plain.self_attn(plain.input_layernorm(x), cos, sin, meta).contiguous()
        total = torch.empty_like(x)  # x + h; h becomes its norm
        lib.add_rms_norm(x.data_ptr(), h.data_ptr(), norm.weight.data_ptr(), total.data_ptr(),
                         h.data_ptr(), *x.shape, norm.eps, bf16)
        mlp = plain.mlp(h).contiguous()
        lib.add(total.data_ptr(), mlp.data_ptr(), total.data_ptr(), *x.shape, bf16)
        return total


def step_pointers(cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata) -> tuple:
    """decode_layer's arguments after x and out."""
    return cos.data_ptr(), sin.data_ptr(), *meta_pointers(meta)


def meta_pointers(meta: AttentionMetadata) -> tuple:
    """decode_layer's (and decode_model's) arguments from the metadata: slots to the end."""
    tables = meta.decode_block_tables
    return (meta.slot_mapping.data_ptr(), tables.data_ptr(), meta.decode_context_lens.data_ptr(),
            tables.shape[0], tables.shape[1])


def check(bad: int) -> bool:
    """decode_layer's status: True if it ran, False where a slot, a length or a block id was
    refused (then the modules' checks name it: they raise ValueError)."""
    if bad == -2:
        raise RuntimeError("decode_layer: a GEMM kind the kernel library was not built with")
    return bad < 0


class ModelArgs(ctypes.Structure):
    """csrc/layer.c's `struct model`."""

    _fields_ = [("embed", _P), ("cos", _P), ("sin", _P), ("norm", _P), ("vocab", _I),
                ("max_positions", _I)]


class FusedDecoderModel(nn.Module):
    """DecoderModel.forward in one C call (csrc/layer.c's decode_model: the embedding, cos and
    sin, all the layers and the final norm) on the steps every layer's C takes: one crossing
    from Python a step, not one a layer. The same modules as the DecoderModel it replaces, under
    the same names."""

    def __init__(self, plain: DecoderModel, lib: ctypes.CDLL) -> None:
        super().__init__()
        self.embed_tokens, self.rotary_emb = plain.embed_tokens, plain.rotary_emb
        self.layers, self.norm, self.lib = plain.layers, plain.norm, lib
        self.fused = list(plain.layers)  # FusedDecoderLayers, all of them
        self.args = (ctypes.c_void_p * len(self.fused))(
            *(ctypes.addressof(layer.args) for layer in self.fused))
        self.max_rows = min(layer.max_rows for layer in self.fused)
        self.bound: torch.Tensor | None = None  # layer 0's k_cache when the args were bound
        self.model_args, self.tables = ModelArgs(), None  # set by bind_model

    def bind_model(self) -> bool:
        """The model's fields of decode_model's arguments, from its modules as they are now (the
        loader may have rebuilt the rotary tables); False where the C cannot take them."""
        embed, rope, dtype = self.embed_tokens.weight, self.rotary_emb, self.fused[0].dtype
        tables = (rope.cos_cache, rope.sin_cache)
        if (type(self.embed_tokens) is not nn.Embedding or embed.dtype != dtype
                or not embed.is_contiguous() or type(self.norm) is not FusedRMSNorm
                or self.norm.weight.dtype != dtype
                or any(t.dtype != torch.float32 or not t.is_contiguous()
                       or t.shape[1:] != (self.fused[0].args.D,) for t in tables)):
            return False
        self.model_args = ModelArgs(embed.data_ptr(), tables[0].data_ptr(),
                                    tables[1].data_ptr(), self.norm.weight.data_ptr(),
                                    embed.shape[0], tables[0].shape[0])
        self.tables = tables
        return True

    def bound_tables(self) -> bool:
        """Whether model_args holds the rotary tables the module holds now."""
        rope, tables = self.rotary_emb, self.tables
        return tables is not None and rope.cos_cache is tables[0] and rope.sin_cache is tables[1]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        done, x = 0, None
        if (input_ids.dtype == positions.dtype == torch.int64 and input_ids.is_contiguous()
                and positions.is_contiguous()
                and self.fused[0].takes_step(input_ids.shape[0], meta, self.max_rows)
                and (self.bound_tables() or self.bind_model())):
            if self.fused[0].attn.k_cache is not self.bound:  # the runner binds all at once
                for layer in self.fused:
                    layer.bind_cache()
                self.bound = self.fused[0].attn.k_cache
            x = self.embed_tokens.weight.new_empty(len(input_ids), self.norm.weight.shape[0])
            ran = ctypes.c_int(0)
            bad = self.lib.decode_model(ctypes.byref(self.model_args), self.args, len(self.fused),
                                        input_ids.data_ptr(), positions.data_ptr(), x.data_ptr(),
                                        *meta_pointers(meta), ctypes.byref(ran))
            if bad == -1:
                return x
            check(bad)
            done = ran.value  # a refused layer (its modules raise); -3: a bad id or position
        if not done:
            x = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb.cos_sin(positions, x.dtype)
        n = x.shape[0]
        if n > self.max_rows:  # oneDNN's GEMMs: a row count of a few, warmed at start-up
            x = padded(x, padded_rows(n))
        for layer in self.fused[done:]:
            x = layer(x, cos, sin, meta)
        return self.norm(x[:n])


ROW_STEP = 16  # the row counts beyond the C GEMMs' that oneDNN sees: multiples of this


def padded_rows(n: int) -> int:
    """n rounded up to a multiple of ROW_STEP. oneDNN builds a GEMM for each row count it meets
    (~2.5-3 ms a shape on the AMX Xeon VM, ~12 ms a step's first 390-token prefill, against
    ~62 ms of GEMMs): the steps beyond the C GEMMs are computed on these row counts, the extra
    rows zeros, so that warm_gemms() can build them all at start-up."""
    return -(-n // ROW_STEP) * ROW_STEP


def warm_gemms(model: nn.Module, tokens: int) -> None:
    """Build oneDNN's GEMM of each layer shape for every padded row count beyond the C GEMMs'
    up to min(tokens, WARM_ROWS) (tokens: a step's budget), as a server starts, where the first
    steps of each size would have paid it. oneDNN keys what it builds by the calling thread's
    OpenMP team too, so each is built for the whole team and for one thread fewer, what a server
    steps with while a neighbour keeps one of its cores busy (entrypoints/cpu_share.py; other
    sizes build theirs when they first come): ~1 s each for SmolLM2-135M in bf16 on the AMX
    Xeon VM (2 cores: teams of 2 and 1)."""
    decoder = model.model
    if type(decoder) is not FusedDecoderModel or decoder.max_rows >= tokens:
        return
    shapes: dict[tuple[int, int], CLinear] = {}
    for layer in decoder.fused:
        attn, mlp = layer.plain.self_attn.plain, layer.plain.mlp
        for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
            shapes.setdefault((linear.n, linear.k), linear)
    counts = range(padded_rows(decoder.max_rows + 1), min(tokens, WARM_ROWS) + 1, ROW_STEP)
    builds = [(rows, linear) for rows in counts for linear in shapes.values()
              if linear.max_rows is not None and rows > linear.max_rows]  # oneDNN's rows
    team = torch.get_num_threads()
    try:
        with torch.inference_mode():
            for threads in sorted({team, max(1, team - 1)}, reverse=True):
                torch.set_num_threads(threads)
                for rows, linear in builds:
                    linear.library(torch.zeros(rows, linear.k, dtype=linear.dtype))
    finally:
        torch.set_num_threads(team)


WARM_ROWS = 1024


def layer_args(layer: DecoderLayer) -> tuple[LayerArgs, torch.dtype, int] | None:
    """The layer's weights and sizes for csrc/layer.c, its dtype and row limit; None where it is
    not the fused kind the C composes (Qwen3's head norms, a linear without a C GEMM...)."""
    attn, mlp = layer.self_attn, layer.mlp
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    if (type(attn) is not FusedAttention or type(mlp.act_fn) is not FusedSiluAndMul
            or attn.plain.qk_norm or not all(type(norm) is FusedRMSNorm for norm in norms)
            or norms[0].eps != norms[1].eps or attn.plain.head_dim % 8):
        return None
    attn = attn.plain
    linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    gemms = [gemm_args(lin) for lin in linears]
    dtype = norms[0].weight.dtype
    if (None in gemms or dtype not in (torch.float32, torch.bfloat16)
            or any(norm.weight.dtype != dtype for norm in norms)):
        return None
    (qkv, q_rows), (o, o_rows), (gate_up, g_rows), (down, d_rows) = gemms
    args = LayerArgs(norms[0].weight.data_ptr(), norms[1].weight.data_ptr(), qkv, o, gate_up,
                     down, 0, 0, norms[0].weight.shape[0], attn.num_heads, attn.num_kv_heads,
                     attn.head_dim, mlp.down_proj.k, 0, 0, dtype == torch.bfloat16,
                     norms[0].eps, attn.attn.scale)  # the cache's fields: at each call
    return args, dtype, min(q_rows, o_rows, g_rows, d_rows)


def fuse_layers(model: nn.Module, lib: ctypes.CDLL) -> None:
    """Each DecoderLayer of `model` whose parts the C composes becomes a FusedDecoderLayer
    (after fuse_elementwise, with the C decode attention as the backend)."""
    layers = model.model.layers
    for i, layer in enumerate(layers):
        if type(layer) is DecoderLayer and (found := layer_args(layer)) is not None:
            layers[i] = FusedDecoderLayer(layer, lib, *found)
    if type(model.model) is DecoderModel and all(type(lay) is FusedDecoderLayer
                                                 for lay in layers):
        model.model = FusedDecoderModel(model.model, lib)
