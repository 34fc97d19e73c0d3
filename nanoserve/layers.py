"""Building blocks of the decoder models, tensor-parallel where it matters, and the forward context.

Shape legend used in every tensor comment of nanoserve:
    N = tokens in the batch (all sequences packed, no padding)   S = sequences in the batch
    H / Hkv = query / KV heads on this rank    D = head dim    B = KV block size    V = vocab
Tensor parallelism (Megatron style): qkv and gate/up are column-parallel (each rank holds a slice of
the heads / of the MLP), o and down are row-parallel (partial sums, then one all-reduce), the
embedding and LM head are split by vocab. With one rank every collective is skipped.
The forward context carries the batch layout (cu_seqlens, slot_mapping, block_tables...) from the
model runner to the Attention layers without threading it through every forward signature.
Owns no weights' file format (weights.py) and no kernel (kernels.py).
"""
import functools
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from nanoserve.kernels import (gather_kv, paged_decode, prefill_attention, rms_norm_ref, rotary_and_store, sample,
                               silu_and_mul_ref)


def tp_rank_and_size() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


# ---- forward context ---------------------------------------------------------------------------------
@dataclass(kw_only=True)
class ForwardContext:
    """Batch layout for one forward pass. Read by Attention (all fields) and ParallelLMHead (logits_indices)."""
    is_prefill: bool
    slot_mapping: Tensor  # (N,) int32: cache slot of each new token, block_id * B + offset; -1 writes nowhere
    cu_seqlens_q: Tensor | None = None  # (S+1,) int32 prefill: start of each sequence's new tokens
    cu_seqlens_k: Tensor | None = None  # (S+1,) int32 prefill: start of each sequence's whole context
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    context_slots: Tensor | None = None  # (Nk,) int64 prefill with prefix hits: cache slot of every context token
    context_lens: Tensor | None = None  # (S,) int32 decode: tokens in the cache per sequence
    block_tables: Tensor | None = None  # (S, max_blocks) int32 decode: KV block ids of each sequence
    num_common_blocks: Tensor | None = None  # (1,) int32 decode: leading blocks every sequence shares (cascade)
    logits_indices: Tensor | None = None  # (S,) prefill: the last new token of each sequence


_context: ForwardContext | None = None


@contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    global _context
    assert _context is None, "forward contexts do not nest"
    _context = ctx
    try:
        yield ctx
    finally:
        _context = None


def get_forward_context() -> ForwardContext:
    assert _context is not None, "model called outside forward_context()"
    return _context


# ---- elementwise layers ------------------------------------------------------------------------------
def gpu_compiled(fn: Callable) -> Callable:
    """torch.compile fuses a chain of elementwise ops into one kernel, which on the GPU saves a launch and a
    round trip through memory per op (a decode step has thousands of them). The CPU path stays eager, so
    running and testing nanoserve needs no compiler."""
    compiled = torch.compile(fn, dynamic=True)

    @functools.wraps(fn)
    def dispatch(x: Tensor, *args: object) -> object:
        return compiled(x, *args) if x.is_cuda else fn(x, *args)
    return dispatch


rms_norm = gpu_compiled(rms_norm_ref)


@gpu_compiled
def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    residual = x + residual
    return rms_norm_ref(residual, weight, eps), residual


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """RMS-normalize x; with a residual, first add it (fused add + norm) and also return the sum."""
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return add_rms_norm(x, residual, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding's table (rotate-half layout, as Llama and Qwen checkpoints use); Attention
    applies it (kernels.rotary_and_store)."""

    def __init__(self, head_dim: int, max_position: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)  # (P, D/2)
        self.register_buffer("cos_sin", torch.cat([freqs.cos(), freqs.sin()], -1), persistent=False)  # (P, D)


silu_and_mul = gpu_compiled(silu_and_mul_ref)


# ---- tensor-parallel linears -------------------------------------------------------------------------
class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W's output rows split across ranks. `output_sizes` lists the packed parts
    (q, k, v or gate, up); each part is split separately, so each rank holds its slice of every part."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank_and_size()
        assert all(size % self.tp_size == 0 for size in output_sizes)
        self.shard_sizes = [size // self.tp_size for size in output_sizes]
        out = sum(self.shard_sizes)
        self.weight = nn.Parameter(torch.empty(out, input_size))
        self.weight.weight_loader = self.weight_loader
        self.bias = nn.Parameter(torch.empty(out)) if bias else None
        if bias:
            self.bias.weight_loader = self.weight_loader

    def weight_loader(self, param: Tensor, loaded: Tensor, part: int = 0) -> None:
        """Copy this rank's slice of checkpoint tensor `loaded` (part `part`) into its place in param."""
        size = self.shard_sizes[part]
        start = sum(self.shard_sizes[:part])
        param.data[start:start + size].copy_(loaded.narrow(0, self.tp_rank * size, size))

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = x W^T with W's input columns split across ranks: each rank's partial sum, then all-reduce."""

    def __init__(self, input_size: int, output_size: int) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank_and_size()
        self.shard_size = input_size // self.tp_size
        self.weight = nn.Parameter(torch.empty(output_size, self.shard_size))
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: Tensor, loaded: Tensor) -> None:
        param.data.copy_(loaded.narrow(1, self.tp_rank * self.shard_size, self.shard_size))

    def forward(self, x: Tensor) -> Tensor:
        y = F.linear(x, self.weight)
        if self.tp_size > 1:
            dist.all_reduce(y)
        return y


class VocabParallelEmbedding(nn.Module):
    """Embedding whose vocab rows are split across ranks; a rank looks up only its own ids, then all-reduce."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank_and_size()
        self.shard_size = -(-vocab_size // self.tp_size)  # last shard zero-padded when V % tp != 0
        self.vocab_start = self.tp_rank * self.shard_size
        self.weight = nn.Parameter(torch.zeros(self.shard_size, hidden_size))
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: Tensor, loaded: Tensor) -> None:
        rows = loaded[self.vocab_start:self.vocab_start + self.shard_size]
        param.data[:rows.shape[0]].copy_(rows)

    def forward(self, input_ids: Tensor) -> Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)  # (N, hidden)
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.shard_size)
        y = F.embedding(local.clamp(0, self.shard_size - 1), self.weight) * mine.unsqueeze(1)
        dist.all_reduce(y)
        return y


class ParallelLMHead(VocabParallelEmbedding):
    """Logits for the last token of each sequence; each rank computes its vocab slice, rank 0 gathers them."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__(vocab_size, hidden_size)
        self.vocab_size = vocab_size

    def forward(self, hidden: Tensor) -> Tensor | None:
        ctx = get_forward_context()
        if ctx.logits_indices is not None:
            hidden = hidden[ctx.logits_indices]  # (S, hidden): prefill samples only after a sequence's last token
        logits = F.linear(hidden, self.weight)  # (S, V / tp)
        if self.tp_size == 1:
            return logits
        parts = [torch.empty_like(logits) for _ in range(self.tp_size)] if self.tp_rank == 0 else None
        dist.gather(logits, parts, dst=0)
        return torch.cat(parts, -1)[:, :self.vocab_size] if self.tp_rank == 0 else None


# ---- attention -----------------------------------------------------------------------------------------
class Attention(nn.Module):
    """Rotates q and k (after Qwen3's q/k norm) and writes the new K/V into the paged cache, one fused kernel
    on the GPU; then attends: varlen flash attention for prefill, the paged-decode kernel for decode."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim ** -0.5
        self.k_cache = self.v_cache = torch.tensor([])  # (num_blocks, B, Hkv, D), set by the model runner

    def forward(self, q: Tensor, k: Tensor, v: Tensor, positions: Tensor, cos_sin: Tensor,
                qk_norm: tuple[Tensor, Tensor, float] | None = None) -> Tensor:
        """q (N, H D), k and v (N, Hkv D), views of one projection, at positions (N,) -> (N, H D)."""
        ctx = get_forward_context()
        q = q.view(-1, self.num_heads, self.head_dim)  # (N, H, D)
        k = k.view(-1, self.num_kv_heads, self.head_dim)  # (N, Hkv, D)
        v = v.view(-1, self.num_kv_heads, self.head_dim)  # (N, Hkv, D)
        # the profiling run before the cache exists passes empty caches: no store
        q, k = rotary_and_store(q, k, v, positions, cos_sin, self.k_cache, self.v_cache, ctx.slot_mapping, qk_norm)
        if ctx.is_prefill:
            if ctx.context_slots is not None:  # cached prefix tokens are not in k/v: read all context from the cache
                k, v = gather_kv(self.k_cache, self.v_cache, ctx.context_slots)  # (Nk, Hkv, D)
            o = prefill_attention(q, k, v, ctx.cu_seqlens_q, ctx.cu_seqlens_k,
                                  ctx.max_seqlen_q, ctx.max_seqlen_k, self.scale)
        else:  # on the CPU paged_decode runs its reference, for which num_common_blocks changes nothing
            o = paged_decode(q, self.k_cache, self.v_cache, ctx.block_tables, ctx.context_lens, self.scale,
                             num_common_blocks=ctx.num_common_blocks)
        return o.reshape(-1, self.num_heads * self.head_dim)  # (N, H * D)


# ---- sampling --------------------------------------------------------------------------------------------
class Sampler(nn.Module):
    """One token per row of logits, each row with its own temperature, top-k and top-p."""

    def forward(self, logits: Tensor, temperatures: Tensor | None, uniforms: Tensor | None = None,
                top_ks: Tensor | None = None, top_ps: Tensor | None = None) -> Tensor:
        # logits (S, V); temperatures (S,), None when every row is greedy; uniforms (S,) float32 in [0, 1), one
        # per row, needed with temperatures; top_ks (S,) int, 0 = off; top_ps (S,), 1 = off
        if temperatures is None:
            return logits.argmax(-1)  # (S,)
        if top_ks is None and top_ps is None:
            return sample(logits, temperatures, uniforms)
        scaled = logits.float() / temperatures.clamp(min=1e-5).unsqueeze(1)  # (S, V)
        masked = self.mask_top_k_top_p(scaled, top_ks, top_ps)  # the top token always survives: greedy rows hold
        return sample(masked, (temperatures > 0).float(), uniforms)  # already scaled: T = 1, or 0

    @staticmethod
    def mask_top_k_top_p(logits: Tensor, top_ks: Tensor | None, top_ps: Tensor | None) -> Tensor:
        """Set to -inf every logit outside the top k and outside the smallest set reaching probability p."""
        sorted_logits, order = logits.sort(-1, descending=True)  # (S, V)
        if top_ks is not None:
            ranks = torch.arange(logits.shape[-1], device=logits.device)
            k = torch.where(top_ks > 0, top_ks, logits.shape[-1])
            sorted_logits = sorted_logits.masked_fill(ranks.unsqueeze(0) >= k.unsqueeze(1), float("-inf"))
        if top_ps is not None:
            probs = sorted_logits.softmax(-1)
            # drop a token when the tokens before it already reach p (the most likely token always stays)
            drop = (probs.cumsum(-1) - probs) >= top_ps.unsqueeze(1)
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        return torch.empty_like(logits).scatter_(-1, order, sorted_logits)
