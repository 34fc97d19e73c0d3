"""Overlap scheduling: the next step is scheduled and launched while this one runs on the GPU.

The plain loop (LLMEngine.step) waits for a step's tokens before it schedules the next step, so the
GPU idles while the host postprocesses, schedules and prepares. OverlapLoop runs the same three
calls in another order: launch step N+1, then wait for step N's tokens and postprocess them.
- After a prefill, the next prefill needs none of its tokens; a chunked prompt continues past the
  chunk in flight.
- After a decode, the next decode needs tokens that are not known yet: each sequence that goes on
  gets a PENDING placeholder on the host, while the GPU reads the real token from the previous
  step's output on the device. A sequence that samples EOS is found one step late; that step's
  token is dropped.
Owns: the step in flight and the cancel path for it. A StepLoop (the core's step-loop point), in
the plain loop's place with `overlap_scheduling=True` on a single rank.
"""
import numpy as np

from nanoserve.llm_engine import StepLoop
from nanoserve.model_runner import StepOutput
from nanoserve.scheduler import Batch
from nanoserve.sequence import Sequence

PENDING = -1  # token id placeholder: sampled by a step still running on the GPU


class OverlapLoop(StepLoop):
    # the next step: scheduled, then launched (its StepOutput set), not yet postprocessed
    ahead: tuple[Batch, StepOutput | None] | None = None

    def step(self) -> tuple[list[Sequence], Batch]:
        """Postprocess one step, with the step after it already launched when possible."""
        if self.ahead is None:
            batch, out = self.scheduler.schedule(), None
        else:
            (batch, out), self.ahead = self.ahead, None
        try:
            if out is None:  # launched now, as it was not ahead
                out = self.model_runner.run(batch)
            self._launch_next(batch, out)
            return self._postprocess(batch, out), batch
        except BaseException:  # neither step will be postprocessed
            self.cancel()  # the later one first, so the prompts keep their order
            self.cancel(batch)
            raise

    def _launch_next(self, batch: Batch, out: StepOutput) -> None:
        """Launch the step after `batch` into self.ahead: a prefill after a prefill while prompts
        wait; a decode after a decode when no prompt waits and every sequence has a free slot.
        It is in self.ahead before it launches, so step() cancels it if the launch fails."""
        if batch.is_prefill:
            # a prompt chunked in `batch` goes on after the chunk in flight
            if self.scheduler.waiting and (nxt := self.scheduler.schedule_prefill(batch)).seqs:
                self.ahead = nxt, None  # scheduled: step() cancels it if the launch fails
                self.ahead = nxt, self.model_runner.run(nxt)
        elif (nxt := self._schedule_decode(batch)) is not None:
            rows = {seq.seq_id: i for i, seq in enumerate(batch.seqs)}
            index = np.array([rows[seq.seq_id] for seq in nxt.seqs], np.int64)  # (S,)
            self.ahead = nxt, None  # scheduled: step() cancels it if the launch fails
            # the input tokens are batch's samples, read on the device
            input_ids = out.token_ids[self.model_runner.to_device(index)]
            self.ahead = nxt, self.model_runner.run(nxt, input_ids=input_ids)

    def _schedule_decode(self, batch: Batch) -> Batch | None:
        if self.scheduler.waiting:
            return None  # the next step may be a prompt's prefill
        bm = self.scheduler.block_manager
        seqs = [seq for seq in batch.seqs
                if not seq.is_finished and seq.num_output_tokens + 1 < seq.params.max_tokens]
        # each needs room for one more token
        if not seqs or sum(bm.num_missing_blocks(seq, 1) for seq in seqs) > bm.num_free_blocks:
            return None
        for seq in seqs:
            seq.token_ids.append(PENDING)
            bm.append_slot(seq)
        return Batch.decode(seqs)

    def _postprocess(self, batch: Batch, out: StepOutput) -> list[Sequence]:
        for seq in batch.seqs:
            if seq.token_ids[-1] == PENDING and not seq.is_finished:
                seq.token_ids.pop()  # the real token (postprocess appends it) replaces it
        # a sequence that finished a step ago (EOS seen late) gets no token: postprocess skips it
        return self.postprocess(batch, out, out.tolist())

    def finish(self) -> tuple[list[Sequence], Batch] | None:
        """Postprocess the step in flight (launched for sequences that turned out finished, or
        before a step of another loop's); return it as step() does."""
        if self.ahead is not None:
            (batch, out), self.ahead = self.ahead, None
            return self._postprocess(batch, out), batch

    def cancel(self, batch: Batch | None = None) -> None:
        """Forget a step that will never be postprocessed (by default the one in flight)."""
        if batch is None:
            if self.ahead is None:
                return
            (batch, _), self.ahead = self.ahead, None
        for seq in batch.seqs:
            if seq.token_ids[-1] == PENDING:
                seq.token_ids.pop()
        self.scheduler.cancel(batch)

