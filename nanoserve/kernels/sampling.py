"""Sampling: one token per row of logits, a draw from softmax(logits / T) decided by the row's key.

argmax(p / E), with E ~ Exp(1) drawn per token, is an exact draw from p (the exponential race,
the Gumbel-max trick's twin). Inverse-CDF sampling compares one uniform with a cumulative sum over
the vocabulary, whose rounding adds up differently in every batch; a race only changes its winner
where two candidates are within rounding of each other, as greedy does. Row i's noise comes from a
generator seeded with keys[i] alone, so a seeded row draws the same token in any batch and order.
T = 0 rows take the argmax. extensions/race_sampler.py draws the same way in two Triton kernels.
Called by layers.Sampler (through layers.OPS).
"""

import torch
from torch import Tensor


def sample(logits: Tensor, temperatures: Tensor, keys: Tensor) -> Tensor:
    """One token per row of logits (S, V), decided by the row's key (S,) int64 alone; the (first)
    argmax where temperatures (S,) is 0. Returns (S,) int64. Syncs with the host (the keys)."""
    x = logits.float() / torch.where(temperatures > 0, temperatures, 1.0).unsqueeze(1)  # (S, V)
    gens = [torch.Generator(logits.device).manual_seed(key) for key in keys.tolist()]  # per row
    noise = torch.stack([torch.empty_like(r).exponential_(generator=g) for r, g in zip(x, gens)])
    # argmax(p / E), E ~ Exp(1) per token, samples from p: the exponential race, Gumbel-max's twin
    token = (x.softmax(-1) / noise).argmax(-1)  # (S,)
    return torch.where(temperatures > 0, token, x.argmax(-1))  # T = 0: the (first) argmax
