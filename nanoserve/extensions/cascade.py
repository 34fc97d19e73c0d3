"""GLUE PLACEHOLDER (merged with the kernel branch)."""
import numpy as np
from torch import Tensor

from nanoserve.config import Config
from nanoserve.kernels import decode
from nanoserve.layers import ForwardContext
from nanoserve.models import DecoderModel

CASCADE_MIN_SEQS = 32  # the shared-prefix kernel from this decode batch size on (it costs at tiny)


def cascade_decode(q, k_cache, v_cache, block_tables, context_lens, scale, num_common_blocks=None,
                   num_splits=None):
    return decode.paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale,
                               num_splits=num_splits, num_common_blocks=num_common_blocks)


def common_prefix_blocks(block_tables: np.ndarray, context_lens: np.ndarray,
                         block_size: int) -> int:
    """How many leading block-table columns hold the same full block in every row: a shared
    prefix (prefix-cache hits) that cascade attention reads once for the whole batch."""
    limit = int(context_lens.min()) // block_size
    same = (block_tables[:, :limit] == block_tables[0, :limit]).all(axis=0)  # (limit,)
    return int(same.argmin()) if not same.all() else limit


class Cascade:
    """The decode backend of every Attention layer, and the host side of it: how many leading
    blocks a decode batch shares (model runner, prepare_decode)."""

    def __init__(self, model: DecoderModel, config: Config) -> None:
        self.block_size = config.kvcache_block_size
        self.prefix_caching = config.enable_prefix_caching
        for attn in model.attention_layers():
            attn.decode_backend = self.decode

    @staticmethod
    def decode(q: Tensor, k_cache: Tensor, v_cache: Tensor, ctx: ForwardContext,
               scale: float) -> Tensor:
        return cascade_decode(q, k_cache, v_cache, ctx.block_tables, ctx.context_lens, scale,
                              ctx.num_common_blocks)

    def use_prefix(self, num_seqs: int) -> bool:
        """The shared-prefix kernel for a batch of num_seqs? Only prefix-cache hits share blocks."""
        return self.prefix_caching and num_seqs >= CASCADE_MIN_SEQS

    def num_common_blocks(self, block_tables: np.ndarray,
                          context_lens: np.ndarray) -> np.ndarray | None:
        """(1,) int32: the blocks every sequence of a decode batch shares; None: not looked for."""
        if not self.use_prefix(len(context_lens)):
            return None
        return np.array([common_prefix_blocks(block_tables, context_lens, self.block_size)],
                        np.int32)

