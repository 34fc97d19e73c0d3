"""CPU unit tests of the Scheduler with plain Sequence objects and fake sampled tokens (no model).

The Config comes from a tmp directory holding only a small config.json, so no weights are needed.
Each test drives `schedule()` then `postprocess(batch, fake_token_ids)`, as LLMEngine.step does.
"""
import random

import numpy as np
import pytest
import torch
from transformers import LlamaConfig

from nanoserve.config import Config, SamplingParams, cdiv
from nanoserve.extensions.overlap import PENDING, OverlapLoop
from nanoserve.scheduler import Batch, Scheduler
from nanoserve.sequence import Sequence, SequenceStatus

BS = 4  # tokens per KV block (allowed on the CPU)
EOS = 999
VOCAB = 1000


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny-llama")
    LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                num_hidden_layers=1, vocab_size=VOCAB, max_position_embeddings=4096,
                eos_token_id=EOS, architectures=["LlamaForCausalLM"]).save_pretrained(path)
    return str(path)


def make_scheduler(model_dir: str, **overrides) -> Scheduler:
    kwargs = dict(num_kvcache_blocks=64, kvcache_block_size=BS, max_model_len=64, device="cpu")
    kwargs.update(overrides)
    return Scheduler(Config(model_dir, **kwargs), eos_token_ids={EOS})


def make_seq(token_ids: list[int], **params) -> Sequence:
    return Sequence(token_ids, SamplingParams(**params), BS)


def prompt(n: int, start: int = 0) -> list[int]:
    """n distinct tokens (never EOS): prompts share no prefix blocks unless a test makes them."""
    return [(start + i) % 900 for i in range(n)]


def step(sched: Scheduler, token: int = 7) -> tuple[Batch, list[Sequence]]:
    batch = sched.schedule()
    return batch, sched.postprocess(batch, [token] * len(batch.seqs))


def all_blocks_free(sched: Scheduler) -> bool:
    bm = sched.block_manager
    return bm.num_free_blocks == len(bm.blocks) and all(b.ref_count == 0 for b in bm.blocks)


def test_prefill_respects_token_budget(model_dir):
    sched = make_scheduler(model_dir, max_num_batched_tokens=20)
    seqs = [make_seq(prompt(8, 100 * i)) for i in range(3)]
    for seq in seqs:
        sched.add(seq)
    batch = sched.schedule()
    assert batch.is_prefill and batch.seqs == seqs
    assert batch.num_new_tokens == [8, 8, 4]  # the third gets what is left of the budget
    assert list(sched.running) == seqs[:2] and list(sched.waiting) == [seqs[2]]
    sched.postprocess(batch, [11, 12, 13])
    assert seqs[0].output_token_ids == [11] and seqs[1].output_token_ids == [12]
    # a chunk samples nothing
    assert seqs[2].output_token_ids == [] and seqs[2].num_computed_tokens == 4
    batch = sched.schedule()
    assert batch.is_prefill and batch.seqs == [seqs[2]] and batch.num_new_tokens == [4]


def test_running_set_never_exceeds_max_num_seqs(model_dir):
    sched = make_scheduler(model_dir, max_num_seqs=2)
    seqs = [make_seq(prompt(5, 100 * i), max_tokens=3) for i in range(5)]
    for seq in seqs:
        sched.add(seq)
    order = []
    for _ in range(100):
        if not sched.has_unfinished():
            break
        batch, finished = step(sched)
        assert len(batch.seqs) <= 2 and len(sched.running) + len(finished) <= 2
        order += finished
    assert order == seqs  # first come, first served
    assert all(seq.num_output_tokens == 3 for seq in seqs)


def test_prefill_fills_up_to_max_num_seqs(model_dir):
    sched = make_scheduler(model_dir, max_num_seqs=2)
    a, b, c = (make_seq(prompt(5, 100 * i), max_tokens=2) for i in range(3))
    for seq in (a, b, c):
        sched.add(seq)
    batch, _ = step(sched)
    assert batch.is_prefill and batch.seqs == [a, b]
    assert list(sched.waiting) == [c]
    batch, finished = step(sched)  # the running set is full: no prefill, decode instead
    assert not batch.is_prefill and batch.seqs == [a, b]
    assert finished == [a, b]  # max_tokens=2
    batch, _ = step(sched)
    assert batch.is_prefill and batch.seqs == [c]


def test_decode_respects_max_num_seqs(model_dir):
    """More running sequences than max_num_seqs (a limit lowered since they started) decode in
    turns."""
    sched = make_scheduler(model_dir, max_num_seqs=3)
    seqs = [make_seq(prompt(3, 100 * i), max_tokens=9) for i in range(3)]
    for seq in seqs:
        sched.add(seq)
    for _ in range(3):  # prefill all three (however many steps that takes)
        if len(sched.running) < 3:
            step(sched)
    assert list(sched.running) == seqs
    sched.max_num_seqs = 2
    batch, _ = step(sched)
    assert not batch.is_prefill and batch.seqs == seqs[:2]
    assert list(sched.running) == seqs  # the one left out keeps its place


def test_chunked_prefill_samples_only_after_last_chunk(model_dir):
    sched = make_scheduler(model_dir, max_num_batched_tokens=8)
    long = make_seq(prompt(20), max_tokens=3)
    short = make_seq(prompt(3, 500), max_tokens=3)
    sched.add(long)
    sched.add(short)
    for i, expected_computed in enumerate([8, 16]):
        batch = sched.schedule()
        assert batch.is_prefill and batch.seqs == [long] and batch.num_new_tokens == [8]
        assert sched.postprocess(batch, [111 + i]) == []
        assert long.num_computed_tokens == expected_computed
        assert long.num_tokens == 20 and long.output_token_ids == []  # no token from a chunk
        # still first in line
        assert long.status == SequenceStatus.WAITING and sched.waiting[0] is long
        assert long.num_hashed_blocks == expected_computed // BS  # chunks enter the prefix cache
    batch = sched.schedule()  # the last 4 tokens, then the short prompt fills the budget
    assert batch.is_prefill and batch.seqs == [long, short] and batch.num_new_tokens == [4, 3]
    sched.postprocess(batch, [5, 6])
    assert long.output_token_ids == [5] and short.output_token_ids == [6]
    assert long.num_computed_tokens == 20 and long.status == SequenceStatus.RUNNING
    assert list(sched.running) == [long, short] and not sched.waiting


def test_chunk_blocks_later_prompts(model_dir):
    """A prompt behind a chunked one waits for it: the chunk took the whole budget."""
    sched = make_scheduler(model_dir, max_num_batched_tokens=10)
    long, short = make_seq(prompt(20)), make_seq(prompt(3, 500))
    sched.add(long)
    sched.add(short)
    assert step(sched)[0].seqs == [long]
    batch, _ = step(sched)
    assert batch.seqs == [long] and batch.num_new_tokens == [10]
    batch, _ = step(sched)
    assert batch.is_prefill and batch.seqs == [short]


def test_decode_gives_every_running_sequence_one_token(model_dir):
    sched = make_scheduler(model_dir)
    seqs = [make_seq(prompt(n, 100 * n), max_tokens=10) for n in (3, 4, 9)]
    for seq in seqs:
        sched.add(seq)
    step(sched)
    for i in range(4):
        lengths = [seq.num_tokens for seq in seqs]
        batch = sched.schedule()
        # longest context first (the decode kernel's preferred order); running keeps arrival order
        assert not batch.is_prefill and batch.seqs == seqs[::-1]
        assert batch.num_new_tokens == [1, 1, 1]
        assert list(sched.running) == seqs
        for seq in seqs:  # a slot for the newest token's K/V
            assert len(seq.block_table) == cdiv(seq.num_tokens, BS)
        sched.postprocess(batch, [40 + i, 30 + i, 20 + i])
        assert [seq.num_tokens for seq in seqs] == [n + 1 for n in lengths]
        assert [seq.output_token_ids[-1] for seq in seqs] == [20 + i, 30 + i, 40 + i]
        assert all(seq.num_computed_tokens == seq.num_tokens - 1 for seq in seqs)


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_preemption_frees_newest_and_recomputes_it(model_dir, enable_prefix_caching):
    # 9 blocks of 4 tokens: a, b, d (8-token prompts, 2 blocks each) fit with 3 blocks to spare, one
    # for each one's 3rd block; c (20 tokens, 5 blocks) cannot start
    sched = make_scheduler(model_dir, num_kvcache_blocks=9, max_model_len=36,
                           enable_prefix_caching=enable_prefix_caching)
    params = dict(max_tokens=10, ignore_eos=True)
    a, b, d = (make_seq(prompt(8, 100 * i), **params) for i in range(3))
    c = make_seq(prompt(20, 300), max_tokens=4, ignore_eos=True)
    for seq in (a, b, d, c):
        sched.add(seq)
    batch, _ = step(sched)
    assert batch.seqs == [a, b, d] and list(sched.waiting) == [c]
    for _ in range(50):  # decode until the cache runs out
        batch, _ = step(sched)
        assert not batch.is_prefill
        if batch.seqs != [a, b, d]:
            break
    # at 13 tokens a and b each need a 4th block and none is free: d, the newest, is preempted
    assert batch.seqs == [a, b] and a.num_tokens == b.num_tokens == 14
    assert list(sched.waiting) == [d, c] and list(sched.running) == [a, b]
    assert d.status == SequenceStatus.WAITING and d.block_table == [] and d.num_computed_tokens == 0
    assert d.token_ids[:8] == prompt(8, 200) and d.num_output_tokens == 5  # its output is kept
    bm = sched.block_manager
    assert bm.num_free_blocks == 1
    assert all(bm.blocks[i].ref_count == 1 for i in a.block_table + b.block_table)
    # run to the end; every resumed sequence recomputes its generated tokens in one prefill
    resumed = []
    for _ in range(200):
        if not sched.has_unfinished():
            break
        batch = sched.schedule()
        if batch.is_prefill:
            for seq, num_new in zip(batch.seqs, batch.num_new_tokens):
                assert seq.num_computed_tokens == seq.num_cached_tokens  # from the cache, or 0
                assert num_new == seq.num_tokens - seq.num_cached_tokens  # prompt and output tokens
                if seq.num_output_tokens:
                    resumed.append((seq, seq.num_output_tokens, seq.num_cached_tokens))
        sched.postprocess(batch, [55] * len(batch.seqs))
    assert not sched.has_unfinished()
    assert [seq.num_output_tokens for seq in (a, b, d, c)] == [10, 10, 10, 4]
    assert d in [seq for seq, _, _ in resumed]
    for _, num_out, num_cached in resumed:
        assert num_out >= 1 and num_cached % BS == 0
        if not enable_prefix_caching:
            assert num_cached == 0
    if enable_prefix_caching:  # some of a resumed sequence's blocks were still cached
        assert any(num_cached > 0 for _, _, num_cached in resumed)
    assert all_blocks_free(sched)


def test_lone_sequence_is_never_preempted_into_a_hang(model_dir):
    """With the cache just big enough for one max_model_len sequence, two requests share it by
    preemption and both finish."""
    sched = make_scheduler(model_dir, num_kvcache_blocks=4, max_model_len=16)
    a = make_seq(prompt(4), max_tokens=12, ignore_eos=True)
    b = make_seq(prompt(4, 50), max_tokens=12, ignore_eos=True)
    sched.add(a)
    sched.add(b)
    for _ in range(200):
        if not sched.has_unfinished():
            break
        step(sched)
    assert not sched.has_unfinished() and a.num_output_tokens == b.num_output_tokens == 12
    assert all_blocks_free(sched)


@pytest.mark.parametrize("params, tokens, reason, num_out", [
    pytest.param(dict(max_tokens=5), [3, EOS, 3, 3, 3], "stop", 2, id="eos"),
    pytest.param(dict(max_tokens=3, ignore_eos=True), [EOS] * 5, "length", 3, id="ignore_eos"),
    pytest.param(dict(max_tokens=5, stop_token_ids=[17]), [3, 3, 17, 3, 3], "stop", 3,
                 id="stop_token"),
    pytest.param(dict(max_tokens=5, stop_token_ids=[17], ignore_eos=True), [EOS, 17, 3, 3, 3],
                 "stop", 2, id="stop_token_despite_ignore_eos"),
    pytest.param(dict(max_tokens=4), [3, 3, 3, 3, 3], "length", 4, id="max_tokens"),
    pytest.param(dict(max_tokens=1), [3, 3], "length", 1, id="max_tokens_1_in_prefill"),
    pytest.param(dict(max_tokens=1), [EOS], "stop", 1, id="eos_at_max_tokens"),
])
def test_finish_conditions(model_dir, params, tokens, reason, num_out):
    sched = make_scheduler(model_dir)
    seq = make_seq(prompt(6), **params)
    other = make_seq(prompt(6, 300), max_tokens=20, ignore_eos=True)  # keeps running alongside
    sched.add(seq)
    sched.add(other)
    for i, token in enumerate(tokens):
        batch = sched.schedule()
        finished = sched.postprocess(batch, [token, 3])
        if i + 1 < num_out:
            assert finished == [] and seq.status == SequenceStatus.RUNNING
            continue
        assert finished == [seq]
        break
    assert seq.status == SequenceStatus.FINISHED and seq.finish_reason == reason
    assert seq.output_token_ids == tokens[:num_out]
    assert seq.block_table == [] and seq not in sched.running and seq not in sched.waiting
    assert list(sched.running) == [other] and other.finish_reason is None
    bm = sched.block_manager
    assert bm.num_free_blocks == len(bm.blocks) - len(other.block_table)


def true_token(seq: Sequence, position: int) -> int:
    """The token at `position` of seq: the prompt's, then what the fake GPU samples there, a fixed
    function of (prompt, position) with EOS now and then, so outputs can be checked however often a
    step was redone (and equal prompts get equal outputs, whose blocks the prefix cache then shares
    too)."""
    prompt = seq.token_ids[:seq.num_prompt_tokens]
    if position < len(prompt):
        return prompt[position]
    return random.Random(hash((tuple(prompt), position))).choice([EOS] + list(range(40)) * 6)


def fake_token(seq: Sequence) -> int:
    """What the fake GPU samples for seq's next position (after its last token, PENDING too)."""
    return true_token(seq, seq.num_tokens)


class FakeKVCache:
    """What each cache slot holds: the tokens of the prefix whose last position's K/V was written
    there (K/V depend on the whole prefix). A step writes its new tokens' slots, then reads every
    earlier position of its sequences (as each layer stores before it attends): a read of a slot
    holding anything else is a step that would attend to wrong K/V, the bug class of prefix
    caching and of recovery from failures."""

    def __init__(self) -> None:
        self.slots: dict[int, tuple] = {}

    def run(self, spans: list[tuple[Sequence, int, int]]) -> None:
        for seq, start, num_new in spans:
            for pos in range(start, start + num_new):
                self.slots[self.slot(seq, pos)] = self.prefix(seq, pos)
        for seq, start, _ in spans:
            for pos in range(start):
                assert self.slots.get(self.slot(seq, pos)) == self.prefix(seq, pos), "wrong K/V"

    @staticmethod
    def slot(seq: Sequence, pos: int) -> int:
        return seq.block_table[pos // BS] * BS + pos % BS

    @staticmethod
    def prefix(seq: Sequence, pos: int) -> tuple:
        return tuple(true_token(seq, p) for p in range(pos + 1))


class FakeOutput:
    """A step's samples: on the 'device' (a tensor the next step may index) and, via tolist(),
    on the host, where a failed step's failure surfaces (as a CUDA error would)."""

    def __init__(self, tokens: list[int], failed: bool) -> None:
        self.token_ids, self.failed = torch.tensor(tokens or [0]), failed
        self.extras = {}  # no sampling hook adds anything
        self.host = self.token_ids

    def tolist(self) -> list[int]:
        if self.failed:
            raise RuntimeError("simulated failure")
        return self.token_ids.tolist()



def overlap_loop(sched: Scheduler, runner: "FakeRunner") -> OverlapLoop:
    """OverlapLoop driving sched and runner, its steps recorded by the scheduler alone."""
    return OverlapLoop(sched, runner, lambda batch, _, token_ids: sched.postprocess(batch,
                                                                                   token_ids))


class FakeRunner:
    """ModelRunner's interface without a model: at launch, each sequence's span is derived as
    prepare() derives it, written to a FakeKVCache, and `sample(seq)` is 'sampled'. A step fails
    with probability fail_rate; the steps launched after it, before its failure surfaces, are
    lost too (they would run after it on the GPU)."""

    def __init__(self, sample=fake_token, fail_rate: float = 0.0, rng=None, check=None) -> None:
        self.sample, self.fail_rate, self.rng, self.check = sample, fail_rate, rng, check
        self.kv, self.broken, self.launches, self.num_chunks = FakeKVCache(), False, [], 0

    def to_device(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array)

    def run(self, batch: Batch, input_ids: torch.Tensor | None = None) -> FakeOutput:
        if self.check:
            self.check(batch)
        starts = batch.starts if batch.is_prefill else [seq.num_tokens - 1 for seq in batch.seqs]
        spans = list(zip(batch.seqs, starts, batch.num_new_tokens))
        self.launches.append([(seq.seq_id, start, n) for seq, start, n in spans])
        self.num_chunks += any(start + n < seq.num_tokens for seq, start, n in spans)
        if input_ids is not None:  # a decode launched ahead: its inputs are the last samples
            assert PENDING not in input_ids.tolist()
        self.broken |= self.fail_rate > 0 and self.rng.random() < self.fail_rate
        if not self.broken:
            self.kv.run(spans)
        return FakeOutput([self.sample(seq) for seq in batch.seqs], self.broken)


def plain_step(sched: Scheduler, runner: FakeRunner) -> tuple[list[Sequence], Batch]:
    """LLMEngine.step with overlap off."""
    batch = sched.schedule()
    try:
        tokens = runner.run(batch).tolist()
    except RuntimeError:
        sched.cancel(batch)
        raise
    return sched.postprocess(batch, tokens), batch


def check_state(sched: Scheduler, added: list[Sequence], batch: Batch, budget: int,
                max_num_seqs: int, aborted: set) -> None:
    bm = sched.block_manager
    assert 0 < len(batch.seqs) <= max_num_seqs and len(set(batch.seqs)) == len(batch.seqs)
    assert len(sched.running) <= max_num_seqs
    if batch.is_prefill:
        assert sum(batch.num_new_tokens) <= budget
    else:
        assert batch.num_new_tokens == [1] * len(batch.seqs)
    for i, (seq, num_new) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
        start = batch.starts[i] if batch.is_prefill else seq.num_tokens - 1
        assert num_new >= 1 and start + num_new <= seq.num_tokens
        assert len(seq.block_table) * BS >= start + num_new  # slots for every new K/V
    waiting, running = set(sched.waiting), set(sched.running)
    assert not waiting & running
    assert len(waiting) == len(sched.waiting) and len(running) == len(sched.running)
    refs = [0] * len(bm.blocks)
    for seq in added:
        in_queues = (seq in waiting) + (seq in running)
        assert in_queues == (0 if seq.is_finished or seq in aborted else 1)
        for block_id in seq.block_table:
            refs[block_id] += 1
        for i in range(seq.num_hashed_blocks):  # a shared block holds exactly this one's tokens
            assert bm.blocks[seq.block_table[i]].token_ids == seq.block_tokens(i)
    assert [b.ref_count for b in bm.blocks] == refs
    assert set(bm.free_block_ids) == {i for i, r in enumerate(refs) if r == 0}


def random_workload(rng: random.Random, max_model_len: int) -> list[Sequence]:
    shared = [rng.randrange(40) for _ in range(12)]
    seqs = []
    for _ in range(40):
        n = rng.randint(1, 30)
        tokens = (shared[:n] if rng.random() < 0.5 else []) + [rng.randrange(40) for _ in range(n)]
        tokens = tokens[:30]
        params = SamplingParams(max_tokens=rng.randint(1, max_model_len - len(tokens)),
                                ignore_eos=rng.random() < 0.3,
                                stop_token_ids=(rng.randrange(40),) if rng.random() < 0.2 else ())
        seqs.append(Sequence(tokens, params, BS))
    return seqs


def check_outputs(seqs: list[Sequence], aborted: set) -> None:
    for seq in seqs:
        if seq in aborted:
            continue
        p = seq.params
        assert seq.status == SequenceStatus.FINISHED and 1 <= seq.num_output_tokens <= p.max_tokens
        expected = [true_token(seq, pos) for pos in range(seq.num_prompt_tokens, seq.num_tokens)]
        assert seq.output_token_ids == expected
        stops = set(p.stop_token_ids) | (set() if p.ignore_eos else {EOS})
        assert not stops & set(seq.output_token_ids[:-1])  # it stopped at the first stop token
        last_stops = seq.output_token_ids[-1] in stops
        assert seq.finish_reason == ("stop" if last_stops else "length")
        if seq.finish_reason == "length":
            assert seq.num_output_tokens == p.max_tokens


@pytest.mark.parametrize("seed, enable_prefix_caching, overlap, failures", [
    (0, True, False, False), (1, True, False, False), (2, False, False, False),
    (3, True, True, False), (4, False, True, False), (27, True, True, True),
    (52, True, True, True), (6, True, False, True)])
def test_simulated_run_finishes_everything(model_dir, seed, enable_prefix_caching, overlap,
                                           failures):
    """Many sequences, a tiny cache, chunking, preemption and random tokens: every sequence
    finishes with the right tokens, every step reads only K/V its tokens wrote (FakeKVCache), and
    every block ends free. overlap: driven by OverlapLoop. failures: now and then a step fails
    (the loop cancels it and the step ahead of it) and a sequence of it is aborted (as generate()
    does); some of them had taken a failed step's blocks as cache hits."""
    rng = random.Random(seed)
    budget, max_num_seqs, max_model_len = 16, 4, 40
    sched = make_scheduler(model_dir, num_kvcache_blocks=10, max_model_len=max_model_len,
                           max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                           enable_prefix_caching=enable_prefix_caching)
    seqs = random_workload(rng, max_model_len)
    pending, added, aborted = list(seqs), [], set()
    runner = FakeRunner(fail_rate=0.08 if failures else 0.0, rng=rng, check=lambda batch:
                        check_state(sched, added, batch, budget, max_num_seqs, aborted))
    loop = overlap_loop(sched, runner) if overlap else None
    num_steps = num_failed = num_ahead = 0
    seen_preemption = False
    while pending or sched.has_unfinished() or (loop and loop.ahead):
        for _ in range(rng.randint(0, 3)):  # requests keep arriving during the run
            if pending:
                added.append(pending.pop(0))
                sched.add(added[-1])
        if not sched.has_unfinished() and not (loop and loop.ahead):
            continue
        num_steps += 1
        assert num_steps < 5000, "the scheduler made no progress"
        seen_preemption |= any(s.num_output_tokens and not s.block_table for s in sched.waiting)
        try:
            loop.step() if loop else plain_step(sched, runner)
        except RuntimeError:
            num_failed += 1
            runner.broken = False
            if rng.random() < 0.5:  # the failed step's caller gives up one of its requests
                victim = rng.choice(runner.launches[-1])[0]
                seq = next(s for s in added if s.seq_id == victim)
                if not seq.is_finished:
                    sched.abort([seq])
                    aborted.add(seq)
            continue
        num_ahead += loop is not None and loop.ahead is not None
    assert runner.num_chunks > 0 and seen_preemption  # the workload really exercised both
    assert (num_ahead > 0) == overlap and (num_failed > 0) == failures
    assert (len(aborted) > 0) == failures
    check_outputs(seqs, aborted)
    assert all_blocks_free(sched)


def test_overlap_fills_placeholders_and_drops_the_token_after_eos(model_dir):
    sched = make_scheduler(model_dir)
    a, b = make_seq(prompt(6), max_tokens=10), make_seq(prompt(6, 50), max_tokens=2)
    for seq in (a, b):
        sched.add(seq)
    runner = FakeRunner(sample=lambda seq: EOS if seq is a and seq.num_tokens == 7 else 5)
    loop = overlap_loop(sched, runner)
    loop.step()  # the prefill; no prompt waits, so nothing goes ahead of it
    assert loop.ahead is None and a.output_token_ids == b.output_token_ids == [5]
    finished, _ = loop.step()  # the decode; a's next decode is launched before its tokens are read
    ahead_batch = loop.ahead[0]
    assert ahead_batch.seqs == [a]  # b reached max_tokens: it does not go on
    assert runner.launches[-1] == [(a.seq_id, 7, 1)]  # the pending token's K/V, position 7
    assert finished == [a, b] and a.output_token_ids == [5, EOS] and PENDING not in a.token_ids
    loop.finish()  # the step launched for a: its token is dropped, a already finished
    assert a.output_token_ids == [5, EOS] and a.finish_reason == "stop"
    assert b.output_token_ids == [5, 5] and b.finish_reason == "length"
    assert all_blocks_free(sched) and not sched.has_unfinished()


def test_nothing_goes_ahead_while_prompts_wait_or_blocks_run_short(model_dir):
    sched = make_scheduler(model_dir, num_kvcache_blocks=4, max_model_len=16)
    a, b = make_seq(prompt(8), max_tokens=8), make_seq(prompt(3, 50), max_tokens=8)
    for seq in (a, b):
        sched.add(seq)
    step(sched)  # a: 9 tokens, b: 4 tokens
    decode = sched.schedule()  # a takes the last free block for its 9th token
    loop = overlap_loop(sched, FakeRunner())
    sched.add(make_seq(prompt(4, 100)))
    assert loop._schedule_decode(decode) is None  # a prompt waits: the next step may be a prefill
    sched.waiting.clear()
    assert sched.block_manager.num_free_blocks == 0
    assert loop._schedule_decode(decode) is None  # b's 5th token would need a fifth block
    assert PENDING not in a.token_ids + b.token_ids


def test_later_prompt_of_the_same_prefill_batch_reuses_the_shared_prefix(model_dir):
    sched = make_scheduler(model_dir)
    shared = prompt(8, 300)
    a, b = make_seq(shared + [1, 2]), make_seq(shared + [3])
    for seq in (a, b):
        sched.add(seq)
    batch = sched.schedule()
    assert batch.seqs == [a, b] and batch.num_new_tokens == [10, 1]  # b computes its own token
    assert b.block_table[:2] == a.block_table[:2] and b.num_cached_tokens == 8


def test_prefill_launched_ahead_continues_the_chunk_in_flight(model_dir):
    sched = make_scheduler(model_dir, max_num_batched_tokens=8)
    a, b = make_seq(prompt(20)), make_seq(prompt(5, 100))
    for seq in (a, b):
        sched.add(seq)
    runner = FakeRunner(sample=lambda seq: 7)
    loop = overlap_loop(sched, runner)
    loop.step()  # a's tokens 0-7, and (while they are in flight) 8-15
    assert runner.launches == [[(a.seq_id, 0, 8)], [(a.seq_id, 8, 8)]]
    assert a.num_computed_tokens == 8 and a.output_token_ids == []
    loop.step()  # a's last 4 tokens and b's first 4 of 5 go ahead
    assert runner.launches[2] == [(a.seq_id, 16, 4), (b.seq_id, 0, 4)]
    assert list(sched.waiting) == [b] and list(sched.running) == [a]
    loop.step()
    assert runner.launches[3] == [(b.seq_id, 4, 1)]
    assert a.num_computed_tokens == 20 and a.output_token_ids == [7] and b.num_computed_tokens == 4
    loop.step()  # no prompt waits any more: nothing goes ahead
    assert len(runner.launches) == 4 and b.output_token_ids == [7] and not sched.waiting


def test_a_failed_prefill_cancels_the_prefill_launched_ahead(model_dir):
    sched = make_scheduler(model_dir, max_num_batched_tokens=8)
    a, b, c = make_seq(prompt(10)), make_seq(prompt(3, 100)), make_seq(prompt(9, 200))
    for seq in (a, b, c):
        sched.add(seq)
    runner = FakeRunner(fail_rate=1.0, rng=random.Random(0))
    loop = overlap_loop(sched, runner)
    with pytest.raises(RuntimeError, match="simulated failure"):
        loop.step()
    assert runner.launches[1] == [(a.seq_id, 8, 2), (b.seq_id, 0, 3), (c.seq_id, 0, 3)]
    assert list(sched.waiting) == [a, b, c] and not sched.running and loop.ahead is None
    assert all(seq.status == SequenceStatus.WAITING for seq in (a, b, c))
    runner.fail_rate, runner.broken = 0.0, False
    loop.step()  # nothing was recorded as computed: a runs again from its start
    assert runner.launches[2] == [(a.seq_id, 0, 8)]


def test_a_failed_decode_cancels_the_decode_launched_ahead(model_dir):
    sched = make_scheduler(model_dir)
    a = make_seq(prompt(6), max_tokens=10)
    sched.add(a)
    step(sched)
    runner = FakeRunner(fail_rate=1.0, rng=random.Random(0))
    loop = overlap_loop(sched, runner)
    with pytest.raises(RuntimeError, match="simulated failure"):
        loop.step()  # the decode fails after the next one was launched: neither is postprocessed
    assert len(runner.launches) == 2 and PENDING not in a.token_ids and a.num_tokens == 7
    assert loop.ahead is None
    batch, _ = step(sched)  # the lost step is simply run again
    assert batch.seqs == [a] and a.num_tokens == 8 and a.num_computed_tokens == 7
