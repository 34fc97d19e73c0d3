"""Sampling by inverting the CDF, in two kernels so that none scans a whole row in order.

One uniform u per row, and the token where the row's cumulative softmax probability first exceeds
u; the argmax where the temperature is 0. Per chunk of SAMPLE_CHUNK logits: its max, where it is,
and its softmax mass (a (rows, chunks) grid that reads the logits once); then per row, the chunk
where the cumulative mass passes u, and the token inside it. Owns the draw only: layers.Sampler
masks top-k / top-p and draws the uniforms. Invariant: no host sync, one random number per row.
sample_ref is the definition, the CPU path and the test oracle.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from nanoserve.kernels.common import use_triton

SAMPLE_CHUNK = 2048  # logits per chunk: 75 chunks for Qwen's 151,936 tokens
# below any real logit, yet finite: a chunk of only -inf gets a max, and exp(x - max) no NaN
FINITE_MIN = tl.constexpr(-3.0e38)  # a constexpr: the kernels read it


@triton.jit
def _chunk_stats_kernel(logits_ptr, temperatures_ptr, top_ptr, top_index_ptr, mass_ptr, vocab,
                        row_stride, num_chunks, CHUNK: tl.constexpr):
    row, chunk = tl.program_id(0), tl.program_id(1)
    t = tl.load(temperatures_ptr + row)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)  # (CHUNK,) token ids
    x = tl.load(logits_ptr + row.to(tl.int64) * row_stride + offs, mask=offs < vocab,
                other=float("-inf"))
    x = x.to(tl.float32) / tl.where(t > 0, t, 1.0)  # greedy rows (T = 0) keep their logits: argmax
    top = tl.maximum(tl.max(x, axis=0), FINITE_MIN)  # a chunk of only -inf: mass 0, not NaN
    stats = row * num_chunks + chunk
    tl.store(top_ptr + stats, top)
    # the first max, as torch's argmax
    tl.store(top_index_ptr + stats, chunk * CHUNK + tl.argmax(x, axis=0))
    tl.store(mass_ptr + stats, tl.sum(tl.exp(x - top), axis=0))


@triton.jit
def _first_above(cumulative, target, weights, index):
    """The first index whose cumulative weight exceeds target, never one of weight 0 (rounding can
    put target at or past the total: then the last index of positive weight)."""
    first = tl.sum((cumulative <= target).to(tl.int32), axis=0)
    return tl.minimum(first, tl.max(tl.where(weights > 0, index, 0), axis=0))


@triton.jit
def _pick_token_kernel(logits_ptr, temperatures_ptr, uniforms_ptr, top_ptr, top_index_ptr, mass_ptr,
                       tokens_ptr, vocab, row_stride, num_chunks, CHUNKS_PAD: tl.constexpr,
                       CHUNK: tl.constexpr):
    row = tl.program_id(0)
    t = tl.load(temperatures_ptr + row)
    chunks = tl.arange(0, CHUNKS_PAD)
    stats = row * num_chunks + chunks
    top = tl.load(top_ptr + stats, mask=chunks < num_chunks, other=FINITE_MIN)  # (CHUNKS_PAD,)
    mass = tl.load(mass_ptr + stats, mask=chunks < num_chunks, other=0.0)
    best = tl.argmax(top, axis=0)  # the chunk of the row's max
    row_max = tl.max(top, axis=0)
    weights = mass * tl.exp(top - row_max)  # (CHUNKS_PAD,) each chunk's mass, relative to row_max
    cumulative = tl.cumsum(weights, axis=0)
    target = tl.load(uniforms_ptr + row) * tl.max(cumulative, axis=0)
    chunk = _first_above(cumulative, target, weights, chunks)
    chunk_top = tl.sum(tl.where(chunks == chunk, top, 0.0), axis=0)
    # what is left of the target inside the chunk
    target -= tl.sum(tl.where(chunks == chunk, cumulative - weights, 0.0), axis=0)
    offs = tl.arange(0, CHUNK)
    x = tl.load(logits_ptr + row.to(tl.int64) * row_stride + chunk * CHUNK + offs,
                mask=chunk * CHUNK + offs < vocab, other=float("-inf"))
    # (CHUNK,) probabilities relative to the chunk max
    inside = tl.exp(x.to(tl.float32) / tl.where(t > 0, t, 1.0) - chunk_top)
    target /= tl.exp(chunk_top - row_max)  # in the units of `inside`
    token = chunk * CHUNK + _first_above(tl.cumsum(inside, axis=0), target, inside, offs)
    greedy = tl.load(top_index_ptr + row * num_chunks + best)
    tl.store(tokens_ptr + row, tl.where(t > 0, token, greedy))


def sample(logits: Tensor, temperatures: Tensor, uniforms: Tensor) -> Tensor:
    """One draw per row of logits (S, V) from softmax(logits / T), the argmax (first one) where
    T = 0: the token where the cumulative probability first exceeds uniforms (S,) float32 in [0, 1).
    temperatures (S,) float32. One random number per row, none per logit, no host sync. Returns
    (S,) int64."""
    if not use_triton(logits):
        return sample_ref(logits, temperatures, uniforms)
    (S, V), K = logits.shape, SAMPLE_CHUNK
    assert logits.stride(1) == 1 and temperatures.shape == uniforms.shape == (S,)
    C = triton.cdiv(V, K)
    stats = [torch.empty(S, C, dtype=dtype, device=logits.device)  # (S, C) each
             for dtype in (torch.float32, torch.int64, torch.float32)]  # top, top_index, mass
    out = torch.empty(S, dtype=torch.int64, device=logits.device)
    _chunk_stats_kernel[(S, C)](logits, temperatures, *stats, V, logits.stride(0), C, CHUNK=K)
    _pick_token_kernel[(S,)](logits, temperatures, uniforms, *stats, out, V, logits.stride(0), C,
                             CHUNKS_PAD=triton.next_power_of_2(C), CHUNK=K)
    return out


def sample_ref(logits: Tensor, temperatures: Tensor, uniforms: Tensor) -> Tensor:
    """sample() by its definition (CPU path and test oracle): the whole row's CDF, no chunks."""
    x = logits.float() / torch.where(temperatures > 0, temperatures, 1.0).unsqueeze(1)  # (S, V)
    p = (x - x.amax(-1, keepdim=True)).exp()  # (S, V) unnormalized: the target scales by the total
    cdf = p.cumsum(-1)
    token = (cdf <= (uniforms * cdf[:, -1]).unsqueeze(1)).sum(-1)  # the first token whose CDF > u
    # the last token of probability > 0: rounding can put u * total at or past the total
    last_possible = torch.where(p > 0, torch.arange(p.shape[1], device=p.device), 0).amax(-1)
    return torch.where(temperatures > 0, torch.minimum(token, last_possible), x.argmax(-1))  # (S,)
