"""The paged decode kernels' plain-torch oracle: what kernels.paged_decode and the cascade
extension's cascade_decode must return, on caches full of garbage (NaN) outside the context."""
import torch
import torch.nn.functional as F
from torch import Tensor


def paged_decode_ref(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                     context_lens: Tensor, scale: float, chunk: int = 32) -> Tensor:
    """Plain-torch paged decode (CPU path and test oracle; syncs once): `chunk` sequences at a time,
    their blocks gathered from the cache, padded to the chunk's longest context and masked. Reads no
    block-table entry past a sequence's blocks (those may hold garbage) and zeroes the padding, so
    garbage in the cache, even NaN, never reaches the output."""
    (S, H, D), (B, Hkv) = q.shape, k_cache.shape[1:3]
    assert H % Hkv == 0 and block_tables.shape[0] == S and context_lens.shape == (S,)
    out = torch.zeros_like(q)  # (S, H, D); context_len 0 (a padded graph row) attends to nothing
    for c in range(0, S, chunk):
        lens = context_lens[c:c + chunk].long()  # (C,)
        num_blocks = int(lens.max() + B - 1) // B  # host sync
        valid = torch.arange(num_blocks * B, device=q.device) < lens[:, None]  # (C, L)
        # a block is the sequence's when its first token is: later table entries are never read
        blocks = torch.where(valid[:, ::B], block_tables[c:c + chunk, :num_blocks], 0)  # (C, nb)
        # (C, nb, B, Hkv, D) -> (C, L, Hkv, D) in fp32; the padding zeroed (only its rows, the cheap
        # way): a masked score must not be NaN + (-inf), nor a zero weight times a NaN value
        k, v = (cache[blocks].flatten(1, 2).float() for cache in (k_cache, v_cache))
        padding = (~valid).flatten().nonzero().squeeze(1)  # (P,) rows of (C * L)
        k.view(-1, Hkv, D).index_fill_(0, padding, 0.0)
        v.view(-1, Hkv, D).index_fill_(0, padding, 0.0)
        o = F.scaled_dot_product_attention(q[c:c + chunk, :, None].float(), k.transpose(1, 2),
                                           v.transpose(1, 2), attn_mask=valid[:, None, None, :],
                                           scale=scale, enable_gqa=True)  # (C, H, 1, D)
        out[c:c + chunk] = torch.where(lens[:, None, None] > 0, o[:, :, 0], 0.0)  # (C, H, D)
    return out
