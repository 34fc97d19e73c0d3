"""Sampling: one token per row of logits, a draw from softmax(logits / T) decided by the row's key.

argmax(logits / T + G), G ~ Gumbel(0, 1) per token, is an exact draw from softmax(logits / T) (the
Gumbel-max trick). Inverse-CDF sampling compares a uniform with a sum over the vocabulary, whose
rounding differs with the batch; a race changes its winner only at near-ties, as greedy does. Token
j of row i takes its noise from an integer hash of (keys[i], j) alone: computed where it is read, no
host sync, the same bits on CPU, GPU and under torch.compile, so a key decides its row's draw in any
batch and order. T = 0 rows take the argmax. Called by the model runner through its backends
(extensions.fused compiles it).
"""

import torch
from torch import Tensor


def mix32(x: Tensor) -> Tensor:
    """lowbias32 (C. Wellons' hash-prospector): 32-bit words to 32 bits, an input bit's flip
    flipping each output bit with probability ~1/2. The words are int32, since a GPU does int64
    arithmetic in several 32-bit steps: products wrap mod 2**32, masks make >> a logical shift,
    and 0x846CA68B is written as its int32 twin."""
    x = (x ^ ((x >> 16) & 0xFFFF)) * 0x7FEB352D
    x = (x ^ ((x >> 15) & 0x1FFFF)) * (0x846CA68B - (1 << 32))
    return x ^ ((x >> 16) & 0xFFFF)


def uniform(keys: Tensor, vocab: int) -> Tensor:
    """(S, V) float32 uniforms strictly inside (0, 1), a pure function of (keys[i], token j)."""
    row = mix32(mix32((keys >> 32).int()) ^ keys.int()).unsqueeze(1)  # (S, 1): both 32-bit halves
    # the row word goes in before and after the token's round: rows whose words differ in low bits
    # would share their noise reordered after one round, after two they share nothing
    bits = mix32(mix32(row ^ torch.arange(vocab, dtype=torch.int32, device=keys.device)) ^ row)
    return (((bits >> 9) & 0x7FFFFF).float() + 0.5) * 2**-23  # the top 23 bits: exact in float32


def sample(logits: Tensor, temperatures: Tensor, keys: Tensor) -> Tensor:
    """One token per row of logits (S, V), decided by the row's key (S,) int64 alone; the (first)
    argmax where temperatures (S,) float32 is 0. Returns (S,) int64."""
    assert temperatures.shape == keys.shape == logits.shape[:1]
    hot = (temperatures > 0).unsqueeze(1)  # (S, 1)
    x = logits.float() / torch.where(hot, temperatures.unsqueeze(1), 1.0)  # (S, V)
    gumbel = -torch.log(-torch.log(uniform(keys, logits.shape[1])))  # (S, V)
    return (x + gumbel * hot).argmax(-1)  # T = 0 rows: no noise, the (first) argmax
