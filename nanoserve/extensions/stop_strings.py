"""Stop strings: a request ends where one of its strings appears, left out of the text.

`SamplingParams(stop=[...])` ends a request where one of its strings first appears in the text,
and leaves the string out.

Stop strings are matched on the text, not on tokens: a string may span several tokens, and a
token may hold more than the string. So a request with stop strings has its text decoded step by
step (a StopStringStream, the core's TextStream that also searches), and while a stop string may
still be completing, its length minus one characters are held back from a stream. An Extension:
on_request gives a request with stop strings its StopStringStream; on_tokens, once a step's
tokens are recorded, finishes the requests whose text stopped.
"""
from transformers import PreTrainedTokenizerFast

from nanoserve.model_runner import Extension, StepOutput
from nanoserve.scheduler import Batch
from nanoserve.sequence import Sequence, TextStream


class StopStringStream(TextStream):
    """A TextStream cut at its first stop string."""

    def __init__(self, tokenizer: PreTrainedTokenizerFast, stop: tuple[str, ...],
                 streamed: bool) -> None:
        super().__init__(tokenizer, streamed)
        self.stop, self.stopped = stop, False  # whether a stop string cut the text

    def update(self, token_ids: list[int], finished: bool) -> None:
        if self.stopped:
            return
        seen = len(self.text)  # characters searched already
        super().update(token_ids, finished)
        # only the new text, and the last len(s) - 1 characters before it, can hold a new match
        hits = [i for s in self.stop if (i := self.text.find(s, max(0, seen - len(s) + 1))) >= 0]
        if hits:
            self.text, self.stopped = self.text[:min(hits)], True

    def delta(self, finished: bool) -> str:
        """The text not handed out yet, less its last len(s) - 1 characters while a stop string
        s may still be completing there."""
        num_held = 0 if finished or self.stopped else max(map(len, self.stop)) - 1
        end = max(self.num_sent_chars, len(self.text) - num_held)
        out, self.num_sent_chars = self.text[self.num_sent_chars:end], end
        return out


class StopStrings(Extension):
    def on_request(self, seq: Sequence, streamed: bool) -> StopStringStream | None:
        if seq.params.stop:
            return StopStringStream(self.engine.tokenizer, seq.params.stop, streamed)

    def on_tokens(self, batch: Batch, out: StepOutput, token_ids: list[int]) -> list[Sequence]:
        """Decode the new tokens of the batch's stop-string requests; finish those that met a
        stop string. Returns them."""
        stopped = []
        for seq in batch.seqs:
            if isinstance(text := self.engine.streams.get(seq.seq_id), StopStringStream):
                text.update(seq.output_token_ids, seq.is_finished)
                if text.stopped and not seq.is_finished:
                    stopped.append(seq)
                elif text.stopped:  # the step ended it otherwise (max_tokens, say): still a stop
                    seq.finish_reason = "stop"
        self.engine.scheduler.abort(stopped, reason="stop")  # finish_reason "stop" for each
        return stopped

