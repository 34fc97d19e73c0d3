"""Building blocks of the decoder models, tensor-parallel where it matters, and the forward context.

Shape legend used in every tensor comment of nanoserve:
    N = tokens in the batch (all sequences packed, no padding)   S = sequences in the batch
    H / Hkv = query / KV heads on this rank    D = head dim    B = KV block size    V = vocab
Tensor parallelism (Megatron style): qkv and gate/up are column-parallel (each rank holds a slice of
the heads / of the MLP), o and down are row-parallel (partial sums, then one all-reduce), the
embedding and LM head are split by vocab. With one rank every collective is skipped.
The forward context carries the batch layout (cu_seqlens, slot_mapping, block_tables...) from the
model runner to the Attention layers without threading it through every forward signature.
Each layer's forward is the plain computation, through the `Backends` it was built with: the
device side's extension point, chosen once by the model runner (an extension whose setting is on
gives others: extensions.fused one Triton kernel for norm + rotary + KV store and compiled ones
for the rest, extensions.cascade its decode attention, extensions.batch_invariant its own).
Owns no weights' file format (weights.py) and no kernel (kernels/).
"""
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from nanoserve import kernels
from nanoserve.config import cdiv


def tp_rank_and_size() -> tuple[int, int]:
    """This process's rank and the tensor-parallel world size; (0, 1) when not distributed."""
    distributed = dist.is_available() and dist.is_initialized()
    return (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)


# ---- forward context -----------------------------------------------------------------------------
Array = np.ndarray | Tensor  # a host array (prepare, the workers' copy) or a device tensor


@dataclass(kw_only=True)
class ForwardContext:
    """A batch's layout for one forward pass. The model runner's prepare() builds it of host arrays
    (what rank 0 sends the workers); on the device the same fields hold tensors, read by Attention
    (and the backends' norm_rotary_store); a CUDA graph's capture passes its buffers."""
    is_prefill: bool
    input_ids: Array | None = None  # (N,) int64
    positions: Array | None = None  # (N,) int64
    slot_mapping: Array  # (N,) int32: each new token's slot, block_id * B + offset; -1: spare
    cu_seqlens_q: Array | None = None  # (S+1,) int32 prefill: start of each sequence's new tokens
    cu_seqlens_k: Array | None = None  # (S+1,) int32 prefill: start of each sequence's context
    # decode: a row per new token (a sequence computing several tokens has several rows)
    context_lens: Array | None = None  # (S,) int32 decode: each row's keys, up to its token
    block_tables: Array | None = None  # (S, max_blocks) int32: each row's sequence's blocks
    num_common_blocks: Array | None = None  # (1,) int32 decode: blocks all share (cascade)
    max_seqlen_q: int = 0  # prefill: the most new tokens of a sequence
    max_seqlen_k: int = 0  # and the longest context
    context_slots: Array | None = None  # (Nk,) int64 prefill: each key's slot, cached or new


_context: ForwardContext | None = None


@contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    global _context
    _context = ctx
    try:
        yield ctx
    finally:
        _context = None


def get_forward_context() -> ForwardContext:
    """The context of the forward pass running now (None outside forward_context())."""
    return _context


# ---- elementwise layers --------------------------------------------------------------------------
def rms_norm(x: Tensor, weight: Tensor, eps: float,
             residual: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """RMS-normalize x; with a residual, first add it (fused add + norm) and return the sum too."""
    if residual is None:
        return kernels.rms_norm_ref(x, weight, eps)
    residual = x + residual
    return kernels.rms_norm_ref(residual, weight, eps), residual


def silu_and_mul(x: Tensor) -> Tensor:
    """SiLU(gate) * up of x (N, 2 I) = [gate | up] -> (N, I)."""
    gate, up = x.chunk(2, -1)  # (N, I) each
    return F.silu(gate) * up


def norm_rotary_store(positions: Tensor, q: Tensor, k: Tensor, v: Tensor, attn: "Attention",
                      rotary: "RotaryEmbedding", q_norm: "RMSNorm | None",
                      k_norm: "RMSNorm | None") -> tuple[Tensor, Tensor]:
    """q/k RMSNorm (Qwen3), rotary, and the K/V store into the paged cache; returns q and k."""
    if q_norm is not None:  # Qwen3: RMS-normalize each head of q and k
        q, k = q_norm(q), k_norm(k)
    q, k = rotary(positions, q, k)  # rotate each head by its token's position
    if attn.k_cache.numel():  # into the paged cache at the tokens' slots (none before it exists)
        kernels.store_kv(k, v, attn.k_cache, attn.v_cache, get_forward_context().slot_mapping)
    return q, k


# ---- attention, and the backends -----------------------------------------------------------------
def paged_decode(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor,
                 ctx: ForwardContext, scale: float) -> Tensor:
    """The core's decode attention: q (S, H, D), one token per row, over its sequence's blocks
    (k and v, already in the cache, are not read again)."""
    return kernels.paged_decode(q, k_cache, v_cache, ctx.block_tables, ctx.context_lens, scale)


def varlen_prefill(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor,
                   ctx: ForwardContext, scale: float, gather_kv: Callable = kernels.gather_kv
                   ) -> Tensor:
    """The core's prefill attention: q (N, H, D) over every key as the cache holds it, prefix
    hits and new tokens ((Nk, Hkv, D), dequantized from an fp8 cache, as decode reads them)."""
    if k_cache.numel():  # (the profiling run, before the cache exists, attends to k and v alone)
        k, v = gather_kv(k_cache, v_cache, ctx.context_slots, q.dtype)
    return kernels.prefill_attention(q, k, v, ctx.cu_seqlens_q, ctx.cu_seqlens_k,
                                     ctx.max_seqlen_q, ctx.max_seqlen_k, scale)

@dataclass
class Backends:
    """What the model computes with: the plain steps here. The model runner chooses one Backends
    when it is built, before the model (an extension whose setting is on gives other steps), and
    every layer keeps the one it was built with."""
    rms_norm: Callable = rms_norm
    silu_and_mul: Callable = silu_and_mul
    norm_rotary_store: Callable = norm_rotary_store
    linear: Callable = F.linear  # y = x W^T + b, the products of every linear layer
    prefill_attention: Callable = varlen_prefill  # both: (q, k, v, k_cache, v_cache, ctx, scale)
    decode_attention: Callable = paged_decode
    sample: Callable = kernels.sample  # the model runner's sampler
    kv_cache_dtype: torch.dtype | None = None  # None: the model's dtype
    # cascade: a decode batch of common_blocks_from rows or more asks common_blocks(block_tables,
    # context_lens) for the blocks all its rows share ((1,) int32)
    common_blocks: Callable | None = None
    common_blocks_from: int = 0


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, backends: Backends) -> None:
        super().__init__()
        self.eps, self.weight, self.backends = eps, nn.Parameter(torch.ones(size)), backends

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """RMS-normalize x; with a residual, first add it (fused add + norm); return the sum too."""
        return self.backends.rms_norm(x, self.weight, self.eps, residual)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding, rotate-half layout (as Llama and Qwen checkpoints use): each
    head's pair (x[i], x[i + D/2]) turns by the angle position * theta^(-2i/D)."""

    def __init__(self, head_dim: int, max_position: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)  # (P, D/2)
        # cos_sin (P, D): D/2 cosines, D/2 sines
        self.register_buffer("cos_sin", torch.cat([freqs.cos(), freqs.sin()], -1), persistent=False)

    def forward(self, positions: Tensor, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        """q (N, H, D) and k (N, Hkv, D) rotated by their tokens' positions (N,)."""
        angles = self.cos_sin[positions]  # (N, D)
        return kernels.rotary_ref(q, angles), kernels.rotary_ref(k, angles)


# ---- tensor-parallel linears ---------------------------------------------------------------------
def sharded_parameter(weight_loader: Callable[..., None], *shape: int) -> nn.Parameter:
    """A parameter for this rank's shard, zeros until loaded: weights.py copies each checkpoint
    tensor in through `param.weight_loader(param, tensor)` (with a part index if packed)."""
    param = nn.Parameter(torch.zeros(shape))
    param.weight_loader = weight_loader
    return param


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W's output rows split across ranks. `output_sizes` lists the packed parts
    (q, k, v or gate, up); each part is split separately: each rank holds a slice of every part."""

    def __init__(self, input_size: int, output_sizes: list[int], backends: Backends,
                 bias: bool = False) -> None:
        super().__init__()
        self.tp_rank, self.tp_size, self.backends = *tp_rank_and_size(), backends
        assert all(size % self.tp_size == 0 for size in output_sizes)
        self.shard_sizes = [size // self.tp_size for size in output_sizes]
        out = sum(self.shard_sizes)
        self.weight = sharded_parameter(self.weight_loader, out, input_size)
        self.bias = sharded_parameter(self.weight_loader, out) if bias else None

    def weight_loader(self, param: Tensor, loaded: Tensor, part: int = 0) -> None:
        """Copy this rank's slice of checkpoint tensor `loaded` (part `part`) into param."""
        size, start = self.shard_sizes[part], sum(self.shard_sizes[:part])  # in param's rows
        param.data[start:start + size].copy_(loaded.narrow(0, self.tp_rank * size, size))

    def forward(self, x: Tensor) -> Tensor:
        return self.backends.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = x W^T with W's input columns split across ranks: partial sums, then all-reduce."""

    def __init__(self, input_size: int, output_size: int, backends: Backends) -> None:
        super().__init__()
        self.tp_rank, self.tp_size, self.backends = *tp_rank_and_size(), backends
        self.shard_size = input_size // self.tp_size
        self.weight = sharded_parameter(self.weight_loader, output_size, self.shard_size)

    def weight_loader(self, param: Tensor, loaded: Tensor) -> None:
        param.data.copy_(loaded.narrow(1, self.tp_rank * self.shard_size, self.shard_size))

    def forward(self, x: Tensor) -> Tensor:
        y = self.backends.linear(x, self.weight)
        if self.tp_size > 1:
            dist.all_reduce(y)
        return y


class VocabParallelEmbedding(nn.Module):
    """Embedding split by vocab rows across ranks: each looks up its own ids, then all-reduce."""

    def __init__(self, vocab_size: int, hidden_size: int, backends: Backends) -> None:
        super().__init__()
        self.tp_rank, self.tp_size, self.backends = *tp_rank_and_size(), backends
        self.shard_size = cdiv(vocab_size, self.tp_size)  # the last shard zero-padded
        self.vocab_size, self.vocab_start = vocab_size, self.tp_rank * self.shard_size
        self.weight = sharded_parameter(self.weight_loader, self.shard_size, hidden_size)

    def weight_loader(self, param: Tensor, loaded: Tensor) -> None:
        rows = loaded[self.vocab_start:self.vocab_start + self.shard_size]
        param.data[:rows.shape[0]].copy_(rows)

    def forward(self, input_ids: Tensor) -> Tensor:  # (N,) -> (N, hidden)
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.shard_size)
        y = F.embedding(local.clamp(0, self.shard_size - 1), self.weight) * mine.unsqueeze(1)
        dist.all_reduce(y)
        return y


class ParallelLMHead(VocabParallelEmbedding):
    """Logits of the chosen rows; each rank computes its vocab slice, rank 0 gathers them."""

    def forward(self, hidden: Tensor, rows: Tensor | None = None) -> Tensor | None:
        """hidden (N, hidden) -> logits (rows, V) on rank 0, None elsewhere. rows: which of
        hidden's rows (prefill: each sequence's last token); None: all (decode)."""
        # (rows, V / tp)
        logits = self.backends.linear(hidden if rows is None else hidden[rows], self.weight)
        if self.tp_size == 1:
            return logits
        # rank 0 gathers every rank's slice of the vocab; the others only send theirs
        parts = None if self.tp_rank else [torch.empty_like(logits) for _ in range(self.tp_size)]
        dist.gather(logits, parts, dst=0)
        return torch.cat(parts, -1)[:, :self.vocab_size] if self.tp_rank == 0 else None


# ---- attention -----------------------------------------------------------------------------------
class Attention(nn.Module):
    """The paged KV cache of one layer, and attention over it: the backends' prefill attention
    (varlen flash attention) and decode attention (the paged-decode kernel). Both read K and V as
    the cache holds them (with an fp8 cache, rounded), so a prompt's output does not depend on
    whether its prefix was cached."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int,
                 backends: Backends) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale, self.backends = head_dim ** -0.5, backends
        self.k_cache = self.v_cache = torch.tensor([])  # (num_blocks, B, Hkv, D), set by the runner

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q (N, H, D), k and v (N, Hkv, D) of the new tokens, already in the cache -> (N, H, D)."""
        ctx = get_forward_context()  # decode: one new token per sequence against its blocks
        b = self.backends
        attend = b.prefill_attention if ctx.is_prefill else b.decode_attention
        return attend(q, k, v, self.k_cache, self.v_cache, ctx, self.scale)
