"""BlockManager: the paged KV cache's bookkeeping (which block is whose) and the prefix cache.

Owns the pool of `num_blocks` KV blocks, their reference counts and the prefix-cache index (chained
hash of a full block -> block id); not the K/V tensors (model_runner) nor scheduling.
Invariant: a block is either in use (ref_count > 0) or in `free_block_ids`, never both; a freed
block whose K/V were computed keeps its hash, so it stays hittable until it is handed out again.
Called by: the scheduler, which allocates, registers, marks computed and frees.
"""
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import xxhash

from nanoserve.config import cdiv
from nanoserve.sequence import Sequence

NO_HASH = -1


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int = NO_HASH  # chained hash of all tokens up to this block's end, once full (registered)
    token_ids: list[int] = field(default_factory=list)  # the tokens it holds, to confirm a hash hit
    computed: bool = False  # K/V in the cache: the step that registered it was postprocessed


def chain_hash(token_ids: list[int], prefix_hash: int) -> int:
    """Hash of a full block, chained to the hash of everything before it.

    The chaining is what makes the index a prefix cache: equal hashes mean equal prefixes."""
    prefix = b"" if prefix_hash == NO_HASH else prefix_hash.to_bytes(8, "little")
    return xxhash.xxh64_intdigest(prefix + np.asarray(token_ids, dtype=np.int64).tobytes())


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int,
                 enable_prefix_caching: bool = True) -> None:
        self.block_size, self.enable_prefix_caching = block_size, enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.hash_to_block_id: dict[int, int] = {}
        # an ordered set: O(1) removal on a hit, O(1) oldest-freed first on allocation (a plain
        # dict's first key is O(deleted keys) to find: iteration skips the removed entries)
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.num_allocated = self.num_freed = self.num_hits = 0  # running counts (extensions.stats)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    # ---- prefill: a whole prompt at once --------------------------------------------------------
    def _find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids of the longest cached prefix of seq's full blocks (none if caching is off).

        A hit also compares the token ids, so a hash collision can never serve wrong K/V."""
        if not self.enable_prefix_caching:
            return []
        hits, prefix_hash = [], NO_HASH
        for i in range(seq.num_tokens // self.block_size):
            tokens = seq.block_tokens(i)
            prefix_hash = chain_hash(tokens, prefix_hash)
            block_id = self.hash_to_block_id.get(prefix_hash)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            hits.append(block_id)
        return hits

    def allocate(self, seq: Sequence) -> bool:
        """Give seq blocks for all its tokens, reusing cached prefix blocks.

        Returns False, changing nothing, if too few blocks are free."""
        assert not seq.block_table
        hits = self._find_cached_prefix(seq)
        num_fresh = self.num_missing_blocks(seq) - len(hits)  # blocks for the tokens past the hits
        num_revived = sum(self.blocks[b].ref_count == 0 for b in hits)  # hits taken from the pool
        if num_revived + num_fresh > self.num_free_blocks:
            return False
        for block in (self.blocks[b] for b in hits):
            # a hit on a freed block takes it back from the pool (a block in use is not in it)
            self.free_block_ids.pop(block.block_id, None)
            block.ref_count += 1
        seq.block_table = hits + [self._allocate_fresh() for _ in range(num_fresh)]
        # logits need at least one computed token: a fully cached prompt recomputes its last one
        seq.num_cached_tokens = min(len(hits) * self.block_size, seq.num_tokens - 1)
        seq.num_computed_tokens, seq.num_hashed_blocks = seq.num_cached_tokens, len(hits)
        self.num_hits += len(hits)
        return True

    def _allocate_fresh(self) -> int:
        """Hand out the least recently freed block, evicting its old prefix-cache entry."""
        block = self.blocks[self.free_block_ids.popitem(last=False)[0]]
        self._unregister(block)
        block.ref_count = 1
        self.num_allocated += 1
        return block.block_id

    def _unregister(self, block: Block) -> None:
        if block.hash != NO_HASH and self.hash_to_block_id.get(block.hash) == block.block_id:
            del self.hash_to_block_id[block.hash]
        block.hash, block.token_ids, block.computed = NO_HASH, [], False

    def free(self, seq: Sequence, keep: int = 0) -> None:
        """Drop seq's references to its blocks past the first `keep` (all by default; a step that
        reserved slots it did not use gives them back); blocks nobody uses go back to the pool.

        A freed computed block keeps its hash and stays hittable until it is handed out again (least
        recently freed first); one registered for a step that never finished has no K/V, so it
        leaves the index."""
        # last block first: a sequence's tail is the least likely prefix of another: evict it first
        for block in (self.blocks[b] for b in reversed(seq.block_table[keep:])):
            block.ref_count -= 1
            assert block.ref_count >= 0
            if block.ref_count == 0:
                if not block.computed:
                    self._unregister(block)
                self.free_block_ids[block.block_id] = None
                self.num_freed += 1
        del seq.block_table[keep:]
        if not keep:
            seq.num_computed_tokens = seq.num_hashed_blocks = 0  # num_cached_tokens: the output

    # ---- decode: one more slot -------------------------------------------------------------------
    def num_missing_blocks(self, seq: Sequence, num_extra_tokens: int = 0) -> int:
        """Fresh blocks seq still needs for the K/V of all its tokens plus num_extra_tokens more."""
        return cdiv(seq.num_tokens + num_extra_tokens, self.block_size) - len(seq.block_table)

    def can_append(self, seq: Sequence) -> bool:
        """Is there room for the K/V of every token seq has (the newest one included)?"""
        return self.num_missing_blocks(seq) <= self.num_free_blocks

    def append_slot(self, seq: Sequence) -> None:
        seq.block_table += [self._allocate_fresh() for _ in range(self.num_missing_blocks(seq))]

    # ---- prefix cache: register the blocks a step computes --------------------------------------
    def register_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Register every full block among seq's first num_tokens tokens (computed, or this step).

        Called at scheduling time by the step that computes the blocks' K/V, so a later prompt of
        the same prefill batch, or of a prefill scheduled before this step finishes, hits them at
        once: safe, since every layer stores the whole batch's K/V before any attention reads the
        cache, and steps run in order."""
        if not self.enable_prefix_caching:
            return
        num_full = num_tokens // self.block_size
        for i in range(seq.num_hashed_blocks, num_full):
            block = self.blocks[seq.block_table[i]]
            prefix_hash = self.blocks[seq.block_table[i - 1]].hash if i > 0 else NO_HASH
            block.token_ids = seq.block_tokens(i)
            block.hash = chain_hash(block.token_ids, prefix_hash)
            # an equal block computed by another sequence in the same batch keeps the index entry
            self.hash_to_block_id.setdefault(block.hash, block.block_id)
        seq.num_hashed_blocks = max(seq.num_hashed_blocks, num_full)

    def mark_computed(self, seq: Sequence, num_new: int) -> None:
        """seq's step computed its last num_new tokens and was postprocessed: the full blocks among
        them have K/V now (the blocks before were marked by earlier steps, or were computed hits).
        Until then a block is registered but not computed, and leaves the index if freed."""
        end = seq.num_computed_tokens
        for i in range((end - num_new) // self.block_size, end // self.block_size):
            self.blocks[seq.block_table[i]].computed = True

    def forget_uncomputed(self, seq: Sequence) -> None:
        """seq's step was cancelled (it or the step before it failed): redo every block without K/V.

        From seq's first full block without K/V on (a cache hit registered by a cancelled step),
        nothing counts as computed, and every block registered but never computed leaves the index.
        seq keeps its blocks and computes those tokens again (register_blocks registers them anew).
        """
        num_full = seq.num_computed_tokens // self.block_size
        blocks = [self.blocks[b] for b in seq.block_table]
        first = next((i for i in range(num_full) if not blocks[i].computed), num_full)
        if first < num_full:
            seq.num_computed_tokens = seq.num_cached_tokens = first * self.block_size
        for block in blocks[first:]:
            if not block.computed:
                self._unregister(block)
        seq.num_hashed_blocks = min(seq.num_hashed_blocks, first)  # blocks before first: computed
