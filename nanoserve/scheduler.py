"""Scheduler: continuous batching over a waiting and a running queue.

Owns: which sequences run in the next step and how many tokens each computes. Each step is either a
prefill batch (prompts, within a token budget; a prompt longer than what is left of the budget is
chunked and continues next step) or a decode batch (one token for every running sequence). When a
decode step finds no free block, the newest running sequence is preempted: its blocks are freed and
it goes back to the front of the waiting queue, to be recomputed later (preemption by recompute).
Does not own: tensors or the model (model_runner), KV block bookkeeping (block_manager).
Invariant: a sequence is in exactly one of `waiting`, `running`, or finished (or aborted: in neither).
Called by: llm_engine (add, schedule, schedule_ahead, postprocess; cancel and abort after a failure).
"""
from collections import deque
from dataclasses import dataclass, field

from nanoserve.block_manager import BlockManager
from nanoserve.config import Config
from nanoserve.sequence import PENDING, Sequence, SequenceStatus


@dataclass
class Batch:
    """One step's work: seqs[i] computes num_new_tokens[i] tokens, starting at its num_computed_tokens; in a
    prefill, at starts[i], which is further along for a chunk continued while its previous chunk still runs."""
    seqs: list[Sequence]
    num_new_tokens: list[int]
    is_prefill: bool
    starts: list[int] = field(default_factory=list)  # prefill: position of each sequence's first new token


class Scheduler:
    def __init__(self, config: Config, eos_token_ids: set[int]) -> None:
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.eos_token_ids = eos_token_ids
        self.block_manager = BlockManager(config.num_kvcache_blocks, config.kvcache_block_size,
                                          config.enable_prefix_caching)
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0  # running count, read by the trace and the tests

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def schedule(self) -> Batch:
        batch = self._schedule_prefill()
        if not batch.seqs:
            batch = self._schedule_decode()
        assert batch.seqs, "nothing schedulable: a sequence larger than the KV cache slipped past validation"
        return batch

    def _schedule_prefill(self, in_flight: int = 0) -> Batch:
        """Take waiting prompts in order while the token budget, the batch size and the free blocks allow.
        in_flight: tokens of the first waiting prompt that a step still running computes (its last chunk)."""
        batch = Batch([], [], is_prefill=True)
        budget = self.max_num_batched_tokens
        # a finished prompt joins `running` at once, so len(running) counts this batch too
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not seq.block_table and not self.block_manager.allocate(seq):
                break  # not enough free blocks: wait for running sequences to finish
            start, in_flight = seq.num_computed_tokens + in_flight, 0
            num_new = min(seq.num_tokens - start, budget)
            # registered now, not after the step: later prompts of this batch reuse these blocks at once
            self.block_manager.register_blocks(seq, start + num_new)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(num_new)
            batch.starts.append(start)
            budget -= num_new
            if start + num_new < seq.num_tokens:
                break  # chunked: the rest of this prompt goes in the next step, still first in line
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
        return batch

    def _schedule_decode(self) -> Batch:
        """One new token for every running sequence, preempting the newest ones when blocks run out."""
        batch = Batch([], [], is_prefill=False)
        while self.running and len(batch.seqs) < self.max_num_seqs:
            seq = self.running.popleft()
            while not self.block_manager.can_append(seq):
                if not self.running:
                    self._preempt(seq)  # the oldest alone does not fit: it waits until blocks free up
                    break
                self._preempt(self.running.pop())
            else:
                self.block_manager.append_slot(seq)
                batch.seqs.append(seq)
                batch.num_new_tokens.append(1)
        self.running.extendleft(reversed(batch.seqs))  # keep arrival order: oldest first
        # the batch itself runs longest context first: the decode kernel starts its programs in batch order,
        # and starting the longest work first lets the SMs finish together (steps scheduled ahead keep it)
        batch.seqs.sort(key=lambda seq: seq.num_tokens, reverse=True)
        return batch

    def schedule_ahead(self, batch: Batch) -> Batch | None:
        """The step after `batch`, scheduled while `batch` still runs on the GPU, so the host prepares it
        meanwhile. After a prefill, the next prefill while prompts wait: it needs none of batch's tokens, and
        continues a chunked prompt past the chunk in flight. After a decode, the next decode: batch's tokens
        are unknown yet, so each sequence that goes on gets a PENDING token, which postprocess(batch) fills in
        (the GPU reads the real one directly); a sequence that samples EOS is found one step late, and that
        step's token is dropped. Decodes go ahead only with no prompt waiting and free blocks for everyone.
        None when nothing is scheduled ahead (the engine waits for batch's tokens first)."""
        if batch.is_prefill:
            chunk = batch.num_new_tokens[-1] if self.waiting and batch.seqs[-1] is self.waiting[0] else 0
            nxt = self._schedule_prefill(in_flight=chunk) if self.waiting else None
            return nxt if nxt and nxt.seqs else None
        if self.waiting:
            return None
        seqs = [seq for seq in batch.seqs if not seq.is_finished and seq.num_output_tokens + 1 < seq.params.max_tokens]
        new_blocks = sum(self.block_manager.num_missing_blocks(seq, num_extra_tokens=1) for seq in seqs)
        if not seqs or new_blocks > self.block_manager.num_free_blocks:
            return None
        for seq in seqs:
            seq.append_token(PENDING)
            self.block_manager.append_slot(seq)
        return Batch(seqs, [1] * len(seqs), is_prefill=False)

    def cancel(self, batch: Batch) -> None:
        """Forget a scheduled step that will never be postprocessed (it or the step before it failed): prompts
        go back to the front of the waiting queue, PENDING tokens are dropped. A sequence keeps its blocks;
        whatever its lost steps computed is computed again."""
        for seq in reversed(batch.seqs if batch.is_prefill else []):
            if seq.status == SequenceStatus.RUNNING:  # (a prompt chunked on is still WAITING, at the head)
                self.running.remove(seq)
                seq.status = SequenceStatus.WAITING
                self.waiting.appendleft(seq)
            self.block_manager.forget_uncomputed(seq)
        for seq in batch.seqs:
            if seq.token_ids[-1] == PENDING:
                seq.token_ids.pop()

    def abort(self, seqs: list[Sequence]) -> None:
        """Drop unfinished sequences from the queues and free their blocks (those a failed step registered but
        never computed leave the prefix cache)."""
        for seq in [seq for seq in seqs if not seq.is_finished]:
            for queue in (self.waiting, self.running):
                if seq in queue:
                    queue.remove(seq)
            self.block_manager.free(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.block_manager.free(seq)
        self.waiting.appendleft(seq)

    def postprocess(self, batch: Batch, token_ids: list[int]) -> list[Sequence]:
        """Record the step's progress and sampled tokens; return the sequences that finished."""
        finished = []
        for seq, num_new, token_id in zip(batch.seqs, batch.num_new_tokens, token_ids):
            if seq.is_finished:
                continue  # it finished in the step before this one, which was scheduled ahead of knowing
            seq.num_computed_tokens += num_new
            self.block_manager.register_blocks(seq, seq.num_computed_tokens)
            self.block_manager.mark_computed(seq, num_new)
            if seq.token_ids[-1] == PENDING:  # the next step already runs with this token
                seq.token_ids[-1] = token_id
            elif seq.num_computed_tokens == seq.num_tokens:
                seq.append_token(token_id)
            else:
                continue  # a prefill chunk: no token is sampled until the whole prompt is in the cache
            seq.finish_reason = self._finish_reason(seq, token_id)
            if seq.finish_reason is not None:
                seq.status = SequenceStatus.FINISHED
                self.block_manager.free(seq)
                self.running.remove(seq)
                finished.append(seq)
        return finished

    def _finish_reason(self, seq: Sequence, token_id: int) -> str | None:
        params = seq.params
        if token_id in params.stop_token_ids or (not params.ignore_eos and token_id in self.eos_token_ids):
            return "stop"
        if seq.num_output_tokens >= params.max_tokens:
            return "length"
        return None
