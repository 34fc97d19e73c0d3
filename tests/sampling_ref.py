"""The Triton sampler's bit-exact twin in plain torch: Triton's Philox 4x32 on the CPU, the same
Gumbel noise and the same two races (extensions/race_sampler.py explains them). A test oracle
only: the core's sampler, kernels.sampling.sample, keeps the contract with torch's own noise.
"""
import torch
import triton
from torch import Tensor

from nanoserve.extensions import race_sampler as sampling

PHILOX_ROUNDS = 10  # as tl.randint4x
PHILOX_ROUND_A, PHILOX_ROUND_B = 0xD2511F53, 0xCD9E8D57  # Philox 4x32's multipliers
PHILOX_KEY_A, PHILOX_KEY_B = 0x9E3779B9, 0xBB67AE85  # and its key increments
UINT32 = 0xFFFFFFFF


def _umulhi(a: int, b: Tensor) -> Tensor:
    """The high 32 bits of a * b for 32-bit a and b (int64 tensor), without int64 overflow."""
    return (a * (b >> 16) + ((a * (b & 0xFFFF)) >> 16)) >> 16


def philox4x32(keys: Tensor, counters: Tensor) -> list[Tensor]:
    """Philox 4x32-10 as Triton's tl.randint4x(key, counter): keys (S,) int64, counters (S, Q)
    int64 -> four (S, Q) tensors of 32-bit values (held in int64)."""
    c0, c1 = counters & UINT32, counters >> 32
    c2 = c3 = torch.zeros_like(c0)
    k0, k1 = (keys & UINT32).unsqueeze(1), ((keys >> 32) & UINT32).unsqueeze(1)  # (S, 1)
    for _ in range(PHILOX_ROUNDS):
        c0, c1, c2, c3 = (_umulhi(PHILOX_ROUND_B, c2) ^ c1 ^ k0, (PHILOX_ROUND_B * c2) & UINT32,
                          _umulhi(PHILOX_ROUND_A, c0) ^ c3 ^ k1, (PHILOX_ROUND_A * c0) & UINT32)
        k0, k1 = (k0 + PHILOX_KEY_A) & UINT32, (k1 + PHILOX_KEY_B) & UINT32
    return [c0, c1, c2, c3]


def gumbel_ref(bits: Tensor) -> Tensor:
    """Gumbel noise of 32-bit values, as the kernels make it (_gumbel)."""
    signed = torch.where(bits >= 2**31, bits - 2**32, bits)  # the bits as an int32
    u = torch.where(signed < 0, -signed - 1, signed).float() * sampling.UNIFORM_SCALE  # [0, 1)
    return -torch.log(-torch.log(u))


def sample_philox_ref(logits: Tensor, temperatures: Tensor, keys: Tensor) -> Tensor:
    """sampling.sample() in plain torch: the same two races, the same noise, token for token.
    Reads sampling.SAMPLE_CHUNK at each call, as sample() does (tests shrink it)."""
    (S, V), K = logits.shape, sampling.SAMPLE_CHUNK
    C, Q = triton.cdiv(V, K), K // 4
    x = logits.float() / torch.where(temperatures > 0, temperatures, 1.0).unsqueeze(1)  # (S, V)
    padded = torch.cat([x, x.new_full((S, C * K - V), float("-inf"))], 1).view(S, C, K)
    lse = padded.logsumexp(-1)  # (S, C)
    noise = gumbel_ref(philox4x32(keys, torch.arange(C, device=keys.device).expand(S, -1))[0])
    chunk = (lse + noise).argmax(-1)  # (S,) the chunk race
    inside = padded.gather(1, chunk.view(S, 1, 1).expand(-1, 1, K)).squeeze(1)  # (S, K)
    # the token race, its noise laid out as the kernel's: four parts of Q, part-major
    counters = sampling.TOKEN_STREAM + chunk.unsqueeze(1) * Q + torch.arange(Q, device=keys.device)
    token = chunk * K + (inside + gumbel_ref(torch.cat(philox4x32(keys, counters), 1))).argmax(-1)
    return torch.where(temperatures > 0, token, x.argmax(-1))  # (S,)
