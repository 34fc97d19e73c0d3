"""The sampler's draw as two Triton kernels: a race of logits / T + Gumbel noise, in two levels,
the noise from Philox keyed by the row (`fused_kernels=True`, on the GPU).

The core's sampler (kernels.sampling) draws argmax(p / Exp(1)) over the whole vocabulary, its
noise from a generator per row. Here a row's token is argmax(logits / T + Gumbel noise), the same
exact draw (the Gumbel-max trick), computed where it is read: Philox is counter-based, so noise is
never stored. The race runs in two levels, both exact: chunks of SAMPLE_CHUNK logits race with
their log-sum-exp (the best score inside a chunk is Gumbel-distributed around it), then the tokens
of the winning chunk race. So a row needs noise for its chunks and one chunk's tokens, not for the
whole vocabulary, and the host never syncs. A race only changes its winner where two candidates are
within rounding of each other, as greedy does: a seeded row draws the same token in any batch.
Attaches at the core's elementwise point (layers.OPS.sample, installed by extensions.fused). The
kernels' bit-exact twin, Philox included, is the tests' oracle (tests/sampling_ref.py).
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from nanoserve.kernels import sampling
from nanoserve.kernels.common import use_triton

SAMPLE_CHUNK = 2048  # logits per chunk: 75 chunks for Qwen's 151,936 tokens
TOKEN_STREAM = 1 << 32  # Philox counters of the token race start here; the chunk race's at 0
UNIFORM_SCALE = 4.6566127342e-10  # 2**-31: a 31-bit integer to a float in [0, 1), as tl.rand
KERNEL_UNIFORM_SCALE = tl.constexpr(UNIFORM_SCALE)  # (kernels read only constexpr globals)
KERNEL_TOKEN_STREAM = tl.constexpr(TOKEN_STREAM)
# below any real logit, yet finite: a chunk of only -inf gets a max, and exp(x - max) no NaN
FINITE_MIN = tl.constexpr(-3.0e38)


@triton.jit
def _gumbel(bits):
    """Gumbel noise -log(-log U) of random bits (int32), U in [0, 1) as tl.rand makes it."""
    x = bits.to(tl.int32, bitcast=True)
    u = tl.where(x < 0, -x - 1, x).to(tl.float32) * KERNEL_UNIFORM_SCALE
    return -tl.log(-tl.log(u))


@triton.jit
def _chunk_stats_kernel(logits_ptr, temperatures_ptr, top_ptr, top_index_ptr, lse_ptr, vocab,
                        row_stride, num_chunks, CHUNK: tl.constexpr):
    row, chunk = tl.program_id(0), tl.program_id(1)  # (rows, chunks): the logits read once
    t = tl.load(temperatures_ptr + row)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)  # (CHUNK,) token ids
    x = tl.load(logits_ptr + row.to(tl.int64) * row_stride + offs, mask=offs < vocab,
                other=float("-inf"))
    x = x.to(tl.float32) / tl.where(t > 0, t, 1.0)  # greedy rows (T = 0) keep their logits
    top = tl.maximum(tl.max(x, axis=0), FINITE_MIN)
    stats = row * num_chunks + chunk
    tl.store(top_ptr + stats, top)
    tl.store(top_index_ptr + stats, chunk * CHUNK + tl.argmax(x, axis=0))  # first max, as torch
    tl.store(lse_ptr + stats, top + tl.log(tl.sum(tl.exp(x - top), axis=0)))  # -inf: all masked


@triton.jit
def _race_part(row_ptr, tokens, vocab, bits, t, best, best_token):
    """Score tokens (Q,) with their noise; keep the better of them and (best, best_token)."""
    x = tl.load(row_ptr + tokens, mask=tokens < vocab, other=float("-inf")).to(tl.float32)
    score = x / tl.where(t > 0, t, 1.0) + _gumbel(bits)  # (a T = 0 row's winner goes unused)
    better = score > best  # a tie keeps the earlier part, whose token is smaller
    return tl.where(better, score, best), tl.where(better, tokens, best_token)


@triton.jit
def _pick_token_kernel(logits_ptr, temperatures_ptr, keys_ptr, top_ptr, top_index_ptr, lse_ptr,
                       tokens_ptr, vocab, row_stride, num_chunks, CHUNKS_PAD: tl.constexpr,
                       CHUNK: tl.constexpr):
    row = tl.program_id(0)
    t, key = tl.load(temperatures_ptr + row), tl.load(keys_ptr + row)
    chunks = tl.arange(0, CHUNKS_PAD)
    stats = row * num_chunks + chunks
    top = tl.load(top_ptr + stats, mask=chunks < num_chunks, other=FINITE_MIN)  # (CHUNKS_PAD,)
    greedy = tl.load(top_index_ptr + row * num_chunks + tl.argmax(top, axis=0))
    lse = tl.load(lse_ptr + stats, mask=chunks < num_chunks, other=float("-inf"))
    chunk = tl.argmax(lse + _gumbel(tl.randint(key, chunks)), axis=0)  # the chunk race
    # the token race inside it: token chunk * CHUNK + part * Q + i takes the part-th number of
    # Philox(key, TOKEN_STREAM + chunk * Q + i), so one call serves four tokens
    Q: tl.constexpr = CHUNK // 4
    offs = tl.arange(0, Q)
    r0, r1, r2, r3 = tl.randint4x(key, offs.to(tl.int64) + chunk * Q + KERNEL_TOKEN_STREAM)
    row_ptr = logits_ptr + row.to(tl.int64) * row_stride
    first = chunk * CHUNK + offs
    best, best_token = tl.full([Q], float("-inf"), tl.float32), first
    best, best_token = _race_part(row_ptr, first, vocab, r0, t, best, best_token)
    best, best_token = _race_part(row_ptr, first + Q, vocab, r1, t, best, best_token)
    best, best_token = _race_part(row_ptr, first + 2 * Q, vocab, r2, t, best, best_token)
    best, best_token = _race_part(row_ptr, first + 3 * Q, vocab, r3, t, best, best_token)
    winner = tl.min(tl.where(best == tl.max(best, axis=0), best_token, vocab), axis=0)
    tl.store(tokens_ptr + row, tl.where(t > 0, winner, greedy))


def sample(logits: Tensor, temperatures: Tensor, keys: Tensor) -> Tensor:
    """One token per row of logits (S, V): a draw from softmax(logits / T) decided by the row's
    key (S,) int64 alone, the (first) argmax where T = 0. temperatures (S,) float32.
    Returns (S,) int64."""
    if not use_triton(logits):  # the core's draw (other noise, the same contract)
        return sampling.sample(logits, temperatures, keys)
    (S, V), K = logits.shape, SAMPLE_CHUNK
    assert logits.stride(1) == 1 and temperatures.shape == keys.shape == (S,)
    C = triton.cdiv(V, K)
    top, lse = (logits.new_empty(S, C, dtype=torch.float32) for _ in range(2))  # (S, C) each
    top_index, out = logits.new_empty(S, C, dtype=torch.int64), torch.empty_like(keys)  # (S,)
    _chunk_stats_kernel[(S, C)](logits, temperatures, top, top_index, lse, V, logits.stride(0), C,
                                CHUNK=K)
    _pick_token_kernel[(S,)](logits, temperatures, keys, top, top_index, lse, out, V,
                             logits.stride(0), C, CHUNKS_PAD=triton.next_power_of_2(C), CHUNK=K)
    return out
