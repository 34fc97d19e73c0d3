"""CPU unit tests of the BlockManager with plain Sequence objects (no model, no Config).

What they pin down: allocation and freeing, reference counts of shared prefix blocks, the chained
prefix-cache hash, what counts as a hit (full computed blocks only), eviction of freed blocks, that
a failed allocation changes nothing, and slot appends at block boundaries.
"""
import random

import pytest

from nanoserve.block_manager import NO_HASH, BlockManager, chain_hash
from nanoserve.config import SamplingParams
from nanoserve.sequence import Sequence

BS = 4  # tokens per block: small, so block boundaries are easy to hit by hand


def make_seq(token_ids: list[int], **params) -> Sequence:
    return Sequence(token_ids, SamplingParams(**params), BS)


def compute(bm: BlockManager, seq: Sequence, num_tokens: int | None = None) -> None:
    """Pretend the model wrote K/V for the first num_tokens (default: all), as postprocess does."""
    num_new = (seq.num_tokens if num_tokens is None else num_tokens) - seq.num_computed_tokens
    seq.num_computed_tokens += num_new
    bm.register_blocks(seq, seq.num_computed_tokens)
    bm.mark_computed(seq, num_new)


def snapshot(bm: BlockManager, *seqs: Sequence) -> tuple:
    """Every piece of state an allocation could touch, comparable (free-list order included)."""
    blocks = [(b.block_id, b.ref_count, b.hash, list(b.token_ids), b.computed) for b in bm.blocks]
    seq_state = [(list(s.block_table), s.num_computed_tokens, s.num_cached_tokens,
                  s.num_hashed_blocks, list(s.token_ids), s.status) for s in seqs]
    counts = (bm.num_allocated, bm.num_freed, bm.num_hits)
    return (list(bm.free_block_ids), blocks, dict(bm.hash_to_block_id), counts, seq_state)


def check_invariants(bm: BlockManager, live: list[Sequence]) -> None:
    """ref_count == number of live block tables naming the block; free exactly when ref_count is 0;
    every index entry points at a block holding that hash; hashed blocks hold their tokens."""
    refs = [0] * len(bm.blocks)
    for seq in live:
        assert len(set(seq.block_table)) == len(seq.block_table), "a block twice in one block table"
        for block_id in seq.block_table:
            refs[block_id] += 1
        for i in range(seq.num_hashed_blocks):
            assert bm.blocks[seq.block_table[i]].token_ids == seq.block_tokens(i)
    assert [b.ref_count for b in bm.blocks] == refs
    assert set(bm.free_block_ids) == {i for i, r in enumerate(refs) if r == 0}
    for h, block_id in bm.hash_to_block_id.items():
        assert bm.blocks[block_id].hash == h


def test_allocate_and_free():
    bm = BlockManager(num_blocks=8, block_size=BS)
    seq = make_seq(list(range(10)))  # 2 full blocks + 2 tokens
    assert bm.allocate(seq)
    assert len(seq.block_table) == 3 and len(set(seq.block_table)) == 3
    assert bm.num_free_blocks == 5
    assert all(bm.blocks[b].ref_count == 1 for b in seq.block_table)
    assert seq.num_computed_tokens == seq.num_cached_tokens == 0  # empty cache: nothing to reuse
    check_invariants(bm, [seq])
    bm.free(seq)
    assert seq.block_table == [] and seq.num_computed_tokens == 0
    assert bm.num_free_blocks == 8
    assert all(b.ref_count == 0 for b in bm.blocks)


def test_blocks_register_only_once_computed():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_seq(list(range(8)))
    assert bm.allocate(a)
    assert bm.hash_to_block_id == {}  # allocated but not computed: nothing to share yet
    b = make_seq(list(range(8)))
    assert bm.allocate(b)
    assert b.num_cached_tokens == 0 and set(a.block_table).isdisjoint(b.block_table)
    compute(bm, a, num_tokens=5)  # one full block computed, the second half-way
    assert a.num_hashed_blocks == 1 and len(bm.hash_to_block_id) == 1
    assert bm.blocks[a.block_table[1]].hash == NO_HASH


def test_shared_prefix_blocks_are_ref_counted():
    bm = BlockManager(num_blocks=10, block_size=BS)
    prefix = list(range(100, 112))  # 3 full blocks
    a = make_seq(prefix + [1, 2])
    assert bm.allocate(a)
    compute(bm, a)
    b = make_seq(prefix + [3, 4, 5])
    assert bm.allocate(b)
    assert b.block_table[:3] == a.block_table[:3]  # the prefix blocks are shared...
    assert b.block_table[3] != a.block_table[3]  # ...the differing tail is not
    assert [bm.blocks[i].ref_count for i in b.block_table] == [2, 2, 2, 1]
    assert b.num_cached_tokens == b.num_computed_tokens == 12 and b.num_hashed_blocks == 3
    assert bm.num_free_blocks == 10 - 5
    check_invariants(bm, [a, b])
    bm.free(a)  # the shared blocks stay in use by b; only a's own tail goes back
    assert [bm.blocks[i].ref_count for i in b.block_table] == [1, 1, 1, 1]
    assert bm.num_free_blocks == 10 - 4
    check_invariants(bm, [b])
    bm.free(b)
    assert bm.num_free_blocks == 10
    check_invariants(bm, [])


def test_hash_chains_the_prefix():
    p1, p2, x = [1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]
    h1, h2 = chain_hash(p1, NO_HASH), chain_hash(p2, NO_HASH)
    assert chain_hash(x, h1) == chain_hash(list(x), chain_hash(list(p1), NO_HASH))  # deterministic
    assert chain_hash(x, h1) != chain_hash(x, h2)  # same tokens, different prefix
    assert chain_hash(x, h1) != chain_hash(x, NO_HASH)  # same tokens, no prefix
    assert chain_hash([1, 2, 3, 4], NO_HASH) != chain_hash([4, 3, 2, 1], NO_HASH)  # order matters

    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_seq(p1 + x)
    assert bm.allocate(a)
    compute(bm, a)
    assert bm.blocks[a.block_table[0]].hash == h1
    assert bm.blocks[a.block_table[1]].hash == chain_hash(x, h1)
    # b's second block equals a's second block token for token, but follows another prefix: no hit
    b = make_seq(p2 + x)
    assert bm.allocate(b)
    assert b.num_cached_tokens == 0 and set(a.block_table).isdisjoint(b.block_table)


def test_hit_on_full_cached_prefix():
    bm = BlockManager(num_blocks=10, block_size=BS)
    a = make_seq(list(range(13)))  # 3 full blocks + 1
    assert bm.allocate(a)
    compute(bm, a)
    hits_before = bm.num_hits
    b = make_seq(list(range(12)) + [77, 78, 79])
    assert bm.allocate(b)
    assert b.num_cached_tokens == 12 and b.num_computed_tokens == 12
    assert b.num_hashed_blocks == 3
    assert bm.num_hits - hits_before == 3
    # a prompt that diverges inside the second block only reuses the first
    c = make_seq(list(range(6)) + [50] * 7)
    assert bm.allocate(c)
    assert c.num_cached_tokens == 4 and c.block_table[0] == a.block_table[0]
    assert c.block_table[1] != a.block_table[1]
    check_invariants(bm, [a, b, c])


def test_partial_last_block_is_not_a_hit():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_seq(list(range(6)))  # 1 full block + 2 tokens in a partial one
    assert bm.allocate(a)
    compute(bm, a)
    assert a.num_hashed_blocks == 1 and len(bm.hash_to_block_id) == 1
    assert bm.blocks[a.block_table[1]].hash == NO_HASH  # a partial block is never registered
    b = make_seq(list(range(6)))
    assert bm.allocate(b)
    assert b.num_cached_tokens == b.num_computed_tokens == 4
    assert b.block_table[0] == a.block_table[0] and b.block_table[1] != a.block_table[1]


def test_fully_cached_prompt_recomputes_last_token():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_seq(list(range(8)))  # exactly 2 full blocks
    assert bm.allocate(a)
    compute(bm, a)
    index_before = dict(bm.hash_to_block_id)
    b = make_seq(list(range(8)))
    assert bm.allocate(b)
    assert b.block_table == a.block_table  # every block is a hit, nothing fresh
    assert bm.num_free_blocks == 6
    # a forward pass needs at least one token to produce logits: the last prompt token is recomputed
    assert b.num_cached_tokens == b.num_computed_tokens == 7
    assert b.num_hashed_blocks == 2
    # finishing that one-token prefill must not re-register or change the shared blocks
    compute(bm, b)
    assert bm.hash_to_block_id == index_before
    # the first output token starts a fresh block of b's own
    b.token_ids.append(42)
    assert bm.can_append(b)
    bm.append_slot(b)
    assert len(b.block_table) == 3 and b.block_table[2] not in a.block_table
    check_invariants(bm, [a, b])


def test_single_block_prompt_fully_cached():
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = make_seq([5, 6, 7, 8])
    assert bm.allocate(a)
    compute(bm, a)
    b = make_seq([5, 6, 7, 8])
    assert bm.allocate(b)
    assert b.num_computed_tokens == 3 and b.block_table == a.block_table


def test_freed_block_stays_hittable_until_reused():
    bm = BlockManager(num_blocks=4, block_size=BS)
    prompt = list(range(8))  # 2 blocks
    a = make_seq(prompt)
    assert bm.allocate(a)
    compute(bm, a)
    a_blocks = list(a.block_table)
    bm.free(a)
    assert bm.num_free_blocks == 4
    # freed, but its K/V are still there: an equal prompt revives both blocks
    b = make_seq(prompt)
    assert bm.allocate(b)
    assert b.block_table == a_blocks
    assert b.num_computed_tokens == 7
    assert bm.num_free_blocks == 2 and all(bm.blocks[i].ref_count == 1 for i in b.block_table)
    check_invariants(bm, [b])
    bm.free(b)
    # a request that needs every block evicts both
    c = make_seq(list(range(1000, 1016)))
    assert bm.allocate(c)
    assert bm.hash_to_block_id == {}
    bm.free(c)  # c was never computed: nothing registered
    d = make_seq(prompt)
    assert bm.allocate(d)
    assert d.num_cached_tokens == d.num_computed_tokens == 0


def test_eviction_takes_least_recently_freed_and_tail_first():
    bm = BlockManager(num_blocks=4, block_size=BS)
    prompt = list(range(8))
    a = make_seq(prompt)
    assert bm.allocate(a)
    compute(bm, a)
    head, tail = a.block_table
    bm.free(a)
    # the two never-used blocks go first, then a's tail (freed before its head)
    c = make_seq(list(range(1000, 1012)))  # 3 blocks
    assert bm.allocate(c)
    assert tail in c.block_table and head not in c.block_table
    assert bm.blocks[tail].hash == NO_HASH  # its old hash is gone with its content
    bm.free(c)
    d = make_seq(prompt)
    assert bm.allocate(d)
    assert d.block_table[0] == head and d.num_cached_tokens == 4


def test_failed_allocation_changes_nothing():
    bm = BlockManager(num_blocks=5, block_size=BS)
    prompt = list(range(8))
    a = make_seq(prompt)
    assert bm.allocate(a)
    compute(bm, a)
    bm.free(a)  # a's 2 blocks: free but cached
    other = make_seq([900, 901])
    assert bm.allocate(other)  # 4 free left, 2 of them cached
    # b hits a's 2 cached blocks (which come out of the free pool too) and needs 3 fresh: 5 > 4
    b = make_seq(prompt + list(range(200, 212)))
    before = snapshot(bm, b, other)
    assert not bm.allocate(b)
    assert snapshot(bm, b, other) == before
    check_invariants(bm, [other])
    # one block fewer fits exactly, and reuses the cached pair
    b2 = make_seq(prompt + list(range(200, 208)))
    assert bm.allocate(b2)
    assert bm.num_free_blocks == 0 and b2.num_cached_tokens == 8
    check_invariants(bm, [other, b2])


def test_failed_allocation_without_cache_changes_nothing():
    bm = BlockManager(num_blocks=3, block_size=BS)
    a = make_seq(list(range(8)))
    assert bm.allocate(a)
    b = make_seq(list(range(50, 58)))
    before = snapshot(bm, a, b)
    assert not bm.allocate(b)
    assert snapshot(bm, a, b) == before


def test_hits_on_blocks_in_use_need_no_free_block():
    bm = BlockManager(num_blocks=4, block_size=BS)
    prompt = list(range(8))
    a = make_seq(prompt)
    assert bm.allocate(a)
    compute(bm, a)
    # 2 free blocks left: b's 2 prefix blocks are a's (already in use), its 2 others are fresh
    b = make_seq(prompt + list(range(300, 308)))
    assert bm.allocate(b)
    assert bm.num_free_blocks == 0 and b.block_table[:2] == a.block_table
    check_invariants(bm, [a, b])


def test_can_append_and_append_slot_at_block_boundaries():
    bm = BlockManager(num_blocks=2, block_size=BS)
    seq = make_seq([1, 2, 3, 4])  # exactly one full block
    assert bm.allocate(seq)
    compute(bm, seq)
    assert len(seq.block_table) == 1
    seq.token_ids.append(5)  # token 5 starts block 2
    assert bm.can_append(seq)
    bm.append_slot(seq)
    assert len(seq.block_table) == 2 and bm.num_free_blocks == 0
    for t in (6, 7, 8):  # fill block 2: no new block, so it works with nothing free
        compute(bm, seq, seq.num_tokens)
        seq.token_ids.append(t)
        assert bm.can_append(seq)
        bm.append_slot(seq)
        assert len(seq.block_table) == 2
    compute(bm, seq, seq.num_tokens)
    assert seq.num_hashed_blocks == 2  # the full second block is registered once computed
    seq.token_ids.append(9)  # needs a third block, and none is free
    assert not bm.can_append(seq)
    bm.free(seq)
    assert bm.num_free_blocks == 2


def test_prefix_caching_disabled_gives_no_hits():
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    a = make_seq(list(range(8)))
    assert bm.allocate(a)
    compute(bm, a)
    assert bm.hash_to_block_id == {}
    b = make_seq(list(range(8)))
    assert bm.allocate(b)
    assert b.num_cached_tokens == b.num_computed_tokens == 0
    assert set(a.block_table).isdisjoint(b.block_table)
    assert bm.num_hits == 0


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_random_workload_frees_every_block(enable_prefix_caching):
    """Allocate, compute, decode and free many sequences with shared prefixes in random order."""
    rng = random.Random(1234)
    bm = BlockManager(num_blocks=24, block_size=BS, enable_prefix_caching=enable_prefix_caching)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(1, 13))] for _ in range(4)]
    live: list[Sequence] = []
    num_hits = 0
    for _ in range(400):
        op = rng.random()
        if op < 0.4:
            suffix = [rng.randrange(50) for _ in range(rng.randrange(0, 6))]
            seq = make_seq(rng.choice(prefixes) + suffix)
            if bm.allocate(seq):
                num_hits += seq.num_cached_tokens > 0
                assert len(seq.block_table) == -(-seq.num_tokens // seq.block_size)
                compute(bm, seq)
                live.append(seq)
            else:
                assert seq.block_table == []
        elif op < 0.75 and live:
            seq = rng.choice(live)
            seq.token_ids.append(rng.randrange(50))
            if bm.can_append(seq):
                bm.append_slot(seq)
                compute(bm, seq)
            else:  # no room: drop it, as a preemption would
                bm.free(seq)
                live.remove(seq)
        elif live:
            seq = live.pop(rng.randrange(len(live)))
            bm.free(seq)
        check_invariants(bm, live)
    assert (num_hits > 0) == enable_prefix_caching
    for seq in live:
        bm.free(seq)
    check_invariants(bm, [])
    assert bm.num_free_blocks == 24 and all(b.ref_count == 0 for b in bm.blocks)


def test_block_registered_for_a_step_that_never_ran_is_dropped_on_free():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_seq(list(range(9)))
    assert bm.allocate(a)
    bm.register_blocks(a, 9)  # as the scheduler does when it schedules a's prefill
    assert len(bm.hash_to_block_id) == 2
    compute(bm, a, num_tokens=4)  # the step failed once the first block's K/V were in place
    bm.free(a)  # (a is aborted)
    assert len(bm.hash_to_block_id) == 1  # the never-computed second block is no longer hittable
    b = make_seq(list(range(9)))
    assert bm.allocate(b) and b.num_cached_tokens == 4


def test_free_keeps_the_hashes_of_computed_blocks_only():
    bm = BlockManager(num_blocks=8, block_size=BS)
    shared = list(range(8))  # 2 full blocks
    a, b = make_seq(shared + [50]), make_seq(shared + [60, 61, 62, 63])
    assert bm.allocate(a)
    compute(bm, a)  # a's prefill finished: its 2 full blocks hold K/V
    assert bm.allocate(b) and b.num_cached_tokens == 8
    bm.register_blocks(b, b.num_tokens)  # b's prefill scheduled (3rd block registered), then fails
    assert len(bm.hash_to_block_id) == 3
    bm.free(b)  # b is aborted: its own block never got K/V
    bm.free(a)
    assert len(bm.hash_to_block_id) == 2 and bm.num_free_blocks == 8
    c = make_seq(shared + [60, 61, 62, 63, 64])
    assert bm.allocate(c) and c.num_cached_tokens == 8  # a's computed blocks served, b's not


def test_a_cancelled_prompt_computes_again_the_hits_that_never_got_kv():
    bm = BlockManager(num_blocks=8, block_size=BS)
    shared = list(range(8))  # 2 full blocks
    a, b = make_seq(shared + [50]), make_seq(shared + [60])
    assert bm.allocate(a)
    bm.register_blocks(a, a.num_tokens)  # registered at scheduling time, for a step that then fails
    assert bm.allocate(b) and b.num_computed_tokens == 8  # b hits a's blocks (same or next prefill)
    bm.register_blocks(b, b.num_tokens)
    shared_ids = b.block_table[:2]
    for seq in (b, a):  # both steps are cancelled, as Scheduler.cancel does
        bm.forget_uncomputed(seq)
    assert b.num_computed_tokens == b.num_cached_tokens == b.num_hashed_blocks == 0
    assert bm.hash_to_block_id == {}  # nothing uncomputed is served...
    bm.free(a)  # (a's request is aborted; b, from elsewhere, goes on)
    c = make_seq(shared + [70])
    assert bm.allocate(c) and c.num_cached_tokens == 0
    bm.free(c)
    compute(bm, b)  # ...until b computes the shared blocks itself, in the blocks it holds
    d = make_seq(shared + [80])
    assert bm.allocate(d) and d.num_cached_tokens == 8 and d.block_table[:2] == shared_ids
    check_invariants(bm, [b, d])


def test_forget_uncomputed_keeps_what_finished_steps_computed():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_seq(list(range(14)))
    assert bm.allocate(a)
    compute(bm, a, num_tokens=6)  # a first chunk of 6 finished: 1 full block, 2 tokens of the next
    bm.register_blocks(a, 14)  # the next chunk is scheduled (block 2 registered), then cancelled
    bm.forget_uncomputed(a)
    assert a.num_computed_tokens == 6 and a.num_hashed_blocks == 1 and len(bm.hash_to_block_id) == 1
