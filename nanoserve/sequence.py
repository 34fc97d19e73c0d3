"""Sequence: one request's tokens, status, progress and block table; TextStream: its text.

Owns: the token list (prompt then output), how many of those tokens already have K/V in the cache
(`num_computed_tokens`), and the ids of the KV blocks that hold them (`block_table`).
Does not own: the blocks themselves (block_manager) or when it runs (scheduler).
Invariant: tokens [0, num_computed_tokens) have K/V in the cache, in the blocks block_table names,
token i in block block_table[i // block_size] at offset i % block_size.
"""
from enum import Enum, auto
from itertools import count

from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizerFast

from nanoserve.config import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()  # not started, preempted, or part-way through a chunked prefill
    RUNNING = auto()  # prompt fully computed; gets one token per decode step
    FINISHED = auto()


class Sequence:
    _ids = count()

    def __init__(self, token_ids: list[int], params: SamplingParams, block_size: int) -> None:
        self.seq_id, self.status = next(Sequence._ids), SequenceStatus.WAITING
        self.token_ids, self.num_prompt_tokens = list(token_ids), len(token_ids)
        self.params, self.block_size = params, block_size
        self.block_table: list[int] = []
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache
        self.num_cached_tokens = 0  # of the prompt, tokens served by the prefix cache
        self.num_hashed_blocks = 0  # leading full blocks already registered in the prefix cache
        self.finish_reason: str | None = None  # "stop", "length", or "abort"
        self.logprobs: list[dict[int, float]] = []  # per output token, with SamplingParams.logprobs

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def block_tokens(self, i: int) -> list[int]:
        """Token ids stored in the i-th block of this sequence."""
        return self.token_ids[i * self.block_size:(i + 1) * self.block_size]


class TextStream:
    """Incremental detokenization of one sequence's output.

    Decoding each new token alone goes wrong twice: a character of several bytes spans several
    tokens (a part decodes to U+FFFD), and tokenizers drop a word's leading space when its token
    starts the text. The tokenizers library's DecodeStream gets both right: it returns a token's
    text once its characters are complete (else None). A request that ends mid-character ends
    with U+FFFD, as a whole decode shows it."""

    def __init__(self, tokenizer: PreTrainedTokenizerFast, streamed: bool) -> None:
        self.tokenizer, self.streamed = tokenizer, streamed
        self.decoder = DecodeStream(skip_special_tokens=True)
        self.num_decoded = self.num_complete = 0  # output tokens decoded; of those, in the text
        self.text = ""
        self.num_sent_chars = self.num_sent_tokens = 0  # handed out by delta() / stream_step()

    def update(self, token_ids: list[int], finished: bool) -> None:
        """Take the output tokens so far."""
        for i in range(self.num_decoded, len(token_ids)):
            piece = self.decoder.step(self.tokenizer.backend_tokenizer, token_ids[i])
            if piece is not None:
                self.text, self.num_complete = self.text + piece, i + 1
        self.num_decoded = len(token_ids)
        if finished and self.num_complete < len(token_ids):  # the end of a broken character
            self.text += self.tokenizer.decode(token_ids[self.num_complete:],
                                               skip_special_tokens=True)
            self.num_complete = len(token_ids)  # (a finished sequence may be seen again)

    def delta(self, finished: bool) -> str:
        """The text not handed out yet (a stop-string stream holds back its end)."""
        out, self.num_sent_chars = self.text[self.num_sent_chars:], len(self.text)
        return out
