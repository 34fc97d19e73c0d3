"""Sampling as a race: each row's token is argmax(logits / T + Gumbel noise), where the noise of
token v comes from Philox keyed by the row's key and counted by v; T = 0 rows race without noise.

argmax(log p + G), G = -log(-log U) with U uniform, is an exact draw from p (the Gumbel-max trick).
Inverse-CDF sampling compares one uniform with a cumulative sum over the vocabulary, whose rounding
errors add up differently in every batch; the race only changes its winner where two candidates
are within rounding of each other, as greedy does. Philox is counter-based: the noise is computed
where it is read, never stored. Owns the race kernel and sample_ref, its plain-torch twin (same
Philox, same noise). Invariant: no host sync. Called by layers.Sampler.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from nanoserve.kernels.common import use_triton

SAMPLE_QUARTER = 1024  # a program races 4 x this many tokens: one Philox call serves four
PHILOX_ROUNDS = 10  # as tl.randint4x
PHILOX_ROUND_A, PHILOX_ROUND_B = 0xD2511F53, 0xCD9E8D57  # Philox 4x32's multipliers
PHILOX_KEY_A, PHILOX_KEY_B = 0x9E3779B9, 0xBB67AE85  # and its key increments
UINT32 = 0xFFFFFFFF
UNIFORM_SCALE = 4.6566127342e-10  # 2**-31: a 31-bit integer to a float in [0, 1), as tl.rand
KERNEL_UNIFORM_SCALE = tl.constexpr(UNIFORM_SCALE)  # (kernels read only constexpr globals)
KERNEL_INT32_MAX = tl.constexpr(2**31 - 1)


@triton.jit
def _race_part(row_ptr, tokens, vocab, bits, t, best, best_token):
    """Score tokens (Q,) with their random bits; keep the better of them and (best, best_token)."""
    x = tl.load(row_ptr + tokens, mask=tokens < vocab, other=float("-inf")).to(tl.float32)
    x_int = bits.to(tl.int32, bitcast=True)
    u = tl.where(x_int < 0, -x_int - 1, x_int).to(tl.float32) * KERNEL_UNIFORM_SCALE  # [0, 1)
    score = tl.where(t > 0, x / tl.where(t > 0, t, 1.0) - tl.log(-tl.log(u)), x)
    better = score > best  # a tie keeps the earlier part, whose token is smaller
    return tl.where(better, score, best), tl.where(better, tokens, best_token)


@triton.jit
def _race_kernel(logits_ptr, temperatures_ptr, keys_ptr, best_ptr, best_token_ptr, vocab,
                 row_stride, num_chunks, QUARTER: tl.constexpr):
    row, chunk = tl.program_id(0), tl.program_id(1)  # program: 4 Q tokens of one row
    t, key = tl.load(temperatures_ptr + row), tl.load(keys_ptr + row)
    offs = tl.arange(0, QUARTER)
    # token chunk * 4Q + part * Q + i takes the part-th number of Philox(key, chunk * Q + i)
    r0, r1, r2, r3 = tl.randint4x(key, chunk * QUARTER + offs)  # (Q,) each
    row_ptr = logits_ptr + row.to(tl.int64) * row_stride
    first = chunk * 4 * QUARTER + offs
    best = tl.full([QUARTER], float("-inf"), tl.float32)
    best_token = first
    best, best_token = _race_part(row_ptr, first, vocab, r0, t, best, best_token)
    best, best_token = _race_part(row_ptr, first + QUARTER, vocab, r1, t, best, best_token)
    best, best_token = _race_part(row_ptr, first + 2 * QUARTER, vocab, r2, t, best, best_token)
    best, best_token = _race_part(row_ptr, first + 3 * QUARTER, vocab, r3, t, best, best_token)
    top = tl.max(best, axis=0)
    # ties go to the smallest token id, as torch.argmax (greedy rows tie in low precision)
    winner = tl.min(tl.where(best == top, best_token, KERNEL_INT32_MAX), axis=0)
    tl.store(best_ptr + row * num_chunks + chunk, top)
    tl.store(best_token_ptr + row * num_chunks + chunk, winner)


def sample(logits: Tensor, temperatures: Tensor, keys: Tensor) -> Tensor:
    """One token per row of logits (S, V): a draw from softmax(logits / T) decided by the row's
    key (S,) int64 alone, the argmax where T = 0. temperatures (S,) float32. Returns (S,) int64."""
    if not use_triton(logits):
        return sample_ref(logits, temperatures, keys)
    (S, V), Q = logits.shape, SAMPLE_QUARTER
    assert logits.stride(1) == 1 and temperatures.shape == keys.shape == (S,)
    C = triton.cdiv(V, 4 * Q)
    best = torch.empty(S, C, dtype=torch.float32, device=logits.device)  # (S, C)
    best_token = torch.empty(S, C, dtype=torch.int32, device=logits.device)
    _race_kernel[(S, C)](logits, temperatures, keys, best, best_token, V, logits.stride(0), C,
                         QUARTER=Q)
    # the first chunk holding the row's best score: chunks run in token order
    return best_token.gather(1, best.argmax(-1, keepdim=True)).squeeze(1).long()


def _umulhi(a: int, b: Tensor) -> Tensor:
    """The high 32 bits of a * b for 32-bit a and b (int64 tensor), without int64 overflow."""
    return (a * (b >> 16) + ((a * (b & 0xFFFF)) >> 16)) >> 16


def philox4x32(keys: Tensor, counters: Tensor) -> list[Tensor]:
    """Philox 4x32-10 as Triton's tl.randint4x(key, counter): keys (S,) int64, counters (Q,)
    int64 -> four (S, Q) tensors of 32-bit values (held in int64)."""
    c0 = (counters & UINT32).expand(len(keys), -1)  # (S, Q)
    c1 = (counters >> 32).expand(len(keys), -1)
    c2 = c3 = torch.zeros_like(c0)
    k0, k1 = (keys & UINT32).unsqueeze(1), ((keys >> 32) & UINT32).unsqueeze(1)  # (S, 1)
    for _ in range(PHILOX_ROUNDS):
        c0, c1, c2, c3 = (_umulhi(PHILOX_ROUND_B, c2) ^ c1 ^ k0, (PHILOX_ROUND_B * c2) & UINT32,
                          _umulhi(PHILOX_ROUND_A, c0) ^ c3 ^ k1, (PHILOX_ROUND_A * c0) & UINT32)
        k0, k1 = (k0 + PHILOX_KEY_A) & UINT32, (k1 + PHILOX_KEY_B) & UINT32
    return [c0, c1, c2, c3]


def gumbel_noise(keys: Tensor, vocab: int) -> Tensor:
    """(S, vocab) float32: the Gumbel noise the race kernel gives each token of each row."""
    Q = SAMPLE_QUARTER
    C = triton.cdiv(vocab, 4 * Q)
    counters = torch.arange(C * Q, device=keys.device).view(C, Q)  # (C, Q)
    parts = philox4x32(keys, counters.flatten())  # 4 x (S, C Q)
    bits = torch.stack([p.view(-1, C, Q) for p in parts], 2).flatten(1)[:, :vocab]  # (S, V)
    signed = torch.where(bits >= 2**31, bits - 2**32, bits)  # the bits as an int32
    u = torch.where(signed < 0, -signed - 1, signed).float() * UNIFORM_SCALE
    return -torch.log(-torch.log(u))


def sample_ref(logits: Tensor, temperatures: Tensor, keys: Tensor) -> Tensor:
    """sample() by its definition (CPU path and test oracle): the whole noise tensor at once."""
    x = logits.float() / torch.where(temperatures > 0, temperatures, 1.0).unsqueeze(1)  # (S, V)
    race = x + gumbel_noise(keys, logits.shape[1])
    return torch.where(temperatures > 0, race.argmax(-1), logits.float().argmax(-1))  # (S,)
