"""Scheduler: continuous batching over a waiting and a running queue.

Owns: which sequences run in the next step and how many tokens each computes. Each step is either a
prefill batch (prompts, within a token budget; a prompt longer than what is left of the budget is
chunked and continues next step) or a decode batch (one token for every running sequence). When a
decode step finds no free block, the newest running sequence is preempted: its blocks are freed and
it goes back to the front of the waiting queue, to be recomputed later (preemption by recompute).
Does not own: tensors or the model (model_runner), KV block bookkeeping (block_manager).
Invariant: a sequence is in exactly one of `waiting` and `running`, or finished (or aborted).
Called by: llm_engine (add, schedule, postprocess; cancel and abort after a failure).
"""
from collections import deque
from dataclasses import dataclass, field

from nanoserve.block_manager import BlockManager
from nanoserve.config import Config
from nanoserve.sequence import Sequence, SequenceStatus


@dataclass
class Batch:
    """One step's work: seqs[i] computes num_new_tokens[i] tokens from position starts[i] (in
    a prefill, past its computed tokens; in a decode, its newest token)."""
    seqs: list[Sequence]
    num_new_tokens: list[int]
    is_prefill: bool
    starts: list[int] = field(default_factory=list)

    @staticmethod
    def decode(seqs: list[Sequence]) -> "Batch":
        """A decode step: every sequence computes its newest token."""
        return Batch(seqs, [1] * len(seqs), False, [seq.num_tokens - 1 for seq in seqs])


class Scheduler:
    def __init__(self, config: Config, eos_token_ids: set[int]) -> None:
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.eos_token_ids = eos_token_ids
        self.block_manager = BlockManager(config.num_kvcache_blocks, config.kvcache_block_size,
                                          config.enable_prefix_caching)
        self.waiting, self.running = deque[Sequence](), deque[Sequence]()
        self.num_preemptions = 0  # since start-up (extensions.stats)

    def add(self, *seqs: Sequence) -> None:
        self.waiting.extend(seqs)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Batch:
        prefill = self.schedule_prefill()  # prompts first; a decode when none can start
        batch = prefill if prefill.seqs else self.schedule_decode()
        assert batch.seqs, "nothing schedulable: a sequence larger than the KV cache got in"
        return batch

    def schedule_prefill(self, in_flight: Batch | None = None) -> Batch:
        """Take waiting prompts in order while the token budget, batch size and blocks allow.
        in_flight: a prefill not postprocessed yet (overlap), whose chunked last prompt goes on
        after the chunk it computes."""
        batch, budget = Batch([], [], is_prefill=True), self.max_num_batched_tokens
        # a finished prompt joins `running` at once, so len(running) counts this batch too
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not seq.block_table and not self.block_manager.allocate(seq):
                break  # not enough free blocks: wait for running sequences to finish
            start = seq.num_computed_tokens  # past the prefix-cache hits
            if in_flight is not None and in_flight.seqs[-1] is seq:
                start += in_flight.num_new_tokens[-1]
            num_new = min(seq.num_tokens - start, budget)
            # registered now, not after the step: later prompts of this batch reuse them at once
            self.block_manager.register_blocks(seq, start + num_new)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(num_new)
            batch.starts.append(start)
            budget -= num_new
            if start + num_new < seq.num_tokens:
                break  # chunked: the rest of this prompt goes in the next step, still first in line
            seq.status = SequenceStatus.RUNNING
            self.running.append(self.waiting.popleft())  # seq, from waiting to running
        return batch

    def schedule_decode(self) -> Batch:
        """One new token for every running sequence, preempting the newest when blocks run out."""
        seqs: list[Sequence] = []
        while self.running and len(seqs) < self.max_num_seqs:
            seq = self.running.popleft()
            while not self.block_manager.can_append(seq):  # checked once when it fits
                if not self.running:
                    self._preempt(seq)  # the oldest alone does not fit: it waits for free blocks
                    break
                self._preempt(self.running.pop())  # the newest gives its blocks back
            else:
                self.block_manager.append_slot(seq)
                seqs.append(seq)
        self.running.extendleft(reversed(seqs))  # keep arrival order: oldest first
        # the batch runs longest context first: the decode kernel starts its programs in batch
        # order, and starting the longest work first lets the SMs finish together
        seqs.sort(key=lambda seq: seq.num_tokens, reverse=True)
        return Batch.decode(seqs)

    def _preempt(self, seq: Sequence) -> None:
        self.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.block_manager.free(seq)
        self.waiting.appendleft(seq)

    def postprocess(self, batch: Batch, token_ids: list[int]) -> list[Sequence]:
        """Record the step's progress and sampled tokens; return the sequences that finished.
        A sequence finished before its step is postprocessed (aborted, or with overlap a step
        launched past its EOS) gets nothing."""
        finished = []
        for seq, num_new, token_id in zip(batch.seqs, batch.num_new_tokens, token_ids):
            if seq.is_finished:
                continue
            seq.num_computed_tokens += num_new
            self.block_manager.register_blocks(seq, seq.num_computed_tokens)
            self.block_manager.mark_computed(seq, num_new)
            if seq.num_computed_tokens < seq.num_tokens:
                continue  # a prefill chunk: no token is sampled until the whole prompt is cached
            seq.token_ids.append(token_id)
            seq.finish_reason = self._finish_reason(seq, token_id)
            if seq.finish_reason is not None:  # it sampled, so it is in `running`, not `waiting`
                seq.status = SequenceStatus.FINISHED
                self.block_manager.free(seq)
                self.running.remove(seq)
                finished.append(seq)
        return finished

    def _finish_reason(self, seq: Sequence, token_id: int) -> str | None:
        p = seq.params
        stop = token_id in p.stop_token_ids or (not p.ignore_eos and token_id in self.eos_token_ids)
        return "stop" if stop else "length" if seq.num_output_tokens >= p.max_tokens else None

    # ---- after a failure ---------------------------------------------------------------------
    def cancel(self, batch: Batch) -> None:
        """Forget a scheduled step that will never be postprocessed: its prompts go back to the
        front of the waiting queue, and whatever it would have computed is computed again."""
        for seq in reversed(batch.seqs if batch.is_prefill else []):
            if seq.status == SequenceStatus.RUNNING:  # (a chunked prompt is still WAITING)
                self.running.remove(seq)
                seq.status = SequenceStatus.WAITING
                self.waiting.appendleft(seq)
            self.block_manager.forget_uncomputed(seq)

    def abort(self, seqs: list[Sequence], reason: str = "abort") -> None:
        """Finish unfinished sequences now: out of the queues, their blocks freed. One in a step
        still in flight (overlap) gets nothing from that step's postprocessing."""
        for seq in [seq for seq in seqs if not seq.is_finished]:
            for queue in (self.waiting, self.running):
                if seq in queue:
                    queue.remove(seq)
            self.block_manager.free(seq)
            seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
