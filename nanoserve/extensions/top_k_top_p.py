"""Top-k and top-p (nucleus) sampling: draws from the likeliest tokens only.

`SamplingParams(top_k=k, top_p=p)` draws only from the k likeliest tokens, and from the fewest
likeliest whose probability reaches p.

An Extension: before_sample, the logits outside the kept set become -inf, so the core's
sampler, which divides by the temperature, draws from the rest with their probabilities
renormalized. The set is chosen at the request's temperature (top-p depends on it), and the
likeliest token always stays: a greedy row stays greedy.
"""
import numpy as np
import torch
from torch import Tensor

from nanoserve.model_runner import Extension
from nanoserve.sequence import Sequence


def mask_top_k_top_p(logits: Tensor, temperatures: Tensor, top_ks: Tensor,
                     top_ps: Tensor) -> Tensor:
    """logits (S, V) with -inf outside each row's top k (top_ks (S,), 0 = off) and outside the
    fewest tokens whose probability at temperatures (S,) reaches top_ps (S,) (1 = off)."""
    # (S, V); a greedy row (T = 0) divides by 1e-5, which keeps its tokens' ranks
    scaled = logits.float() / temperatures.clamp(min=1e-5).unsqueeze(1)
    # stable: tied tokens keep one order, whatever else is in the batch
    sorted_logits, order = scaled.sort(dim=-1, descending=True, stable=True)  # (S, V)
    k = torch.where(top_ks > 0, top_ks, logits.shape[-1]).unsqueeze(1)  # (S, 1)
    drop = torch.arange(logits.shape[-1], device=logits.device) >= k  # (S, V): ranks from k on
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
    # drop a token when the tokens before it reach p (the most likely one always stays); a row
    # with top_p 1 keeps every token, though its rounded sums may reach 1 before the last
    drop |= (probs.cumsum(-1) - probs >= top_ps.unsqueeze(1)) & (top_ps < 1).unsqueeze(1)
    return logits.masked_fill(torch.empty_like(drop).scatter_(-1, order, drop), float("-inf"))


class TopKTopP(Extension):
    def before_sample(self, logits: Tensor, seqs: list[Sequence]) -> Tensor:
        params = [seq.params for seq in seqs]
        if all(p.top_k == 0 and p.top_p == 1 for p in params):
            return logits
        to_device = self.engine.model_runner.to_device
        temperatures = to_device(np.array([p.temperature for p in params], np.float32))
        top_ks = to_device(np.array([p.top_k for p in params], np.int64))
        top_ps = to_device(np.array([p.top_p for p in params], np.float32))
        return mask_top_k_top_p(logits, temperatures, top_ks, top_ps)

