"""LLMEngine (alias LLM): the public entry point, which drives schedule -> run -> postprocess.

It tokenizes and validates requests, loops until they finish, and returns outputs in prompt order.
Owns: the tokenizer, request validation (bad input raises before anything is scheduled, and the
engine stays usable), the engine loop, streaming text and the progress bar.
Extension points (each extension attaches at one, see nanoserve/extensions/):
- the step loop: `self.loop`, None for the plain loop in `step()` (overlap scheduling);
- a step's outputs: `self.observers`, StepObservers that see each step's tokens and its end
  (stop strings, logprobs, the trace, the timeline); the model runner's `sampling_hooks` see the
  logits before and after sampling.
Does not own: batching policy (scheduler), tensors (model_runner), worker processes (distributed).
Invariant: after generate() returns or raises, no sequence of that call is left in the scheduler.
"""
import atexit
import gc
import numbers
import sys
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, suppress
from dataclasses import dataclass, fields

import numpy as np
from tokenizers.decoders import DecodeStream
from tqdm.auto import tqdm
from transformers import AutoTokenizer, GenerationConfig, PreTrainedTokenizerFast

from nanoserve.config import Config, SamplingParams, extension
from nanoserve.distributed import Workers
from nanoserve.model_runner import ModelRunner, StepOutput
from nanoserve.scheduler import Batch, Scheduler
from nanoserve.sequence import Sequence
from nanoserve.weights import default_model_dir

# SamplingParams fields that ask for an extension when not at their default: field -> extension
REQUEST_EXTENSIONS = {"stop": "stop_strings", "logprobs": "logprobs", "top_k": "top_k_top_p",
                      "top_p": "top_k_top_p", "guided_decoding": "guided"}


class StepObserver:
    """Extension point "a step's outputs": every hook a no-op here; an extension overrides the
    ones it needs and is added to LLMEngine.observers."""

    def on_tokens(self, batch: Batch, out: StepOutput, token_ids: list[int]) -> None:
        """A step's sampled tokens (host lists, synced), before the scheduler records them."""

    def after_step(self, batch: Batch, finished: list[Sequence]) -> list[Sequence]:
        """The step is recorded; return the sequences this extension finished in it."""
        return []

    def on_abort(self, seq: Sequence) -> None:
        """seq was aborted between steps."""


@dataclass
class RequestOutput:
    """What one step added to a streamed request. Its `text` deltas add up to the whole text."""
    request_id: int  # the Sequence's seq_id
    text: str  # the new text
    token_ids: list[int]  # the new tokens
    logprobs: list[dict[int, float]] | None  # per new token, with SamplingParams(logprobs=k)
    finish_reason: str | None  # None until the last output: "stop", "length" or "abort"
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens served by the prefix cache
    num_output_tokens: int  # so far


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


class LLMEngine(AbstractContextManager):  # `with LLM(...) as llm:` shuts it down at the end
    def __init__(self, model: str | None = None, **kwargs) -> None:
        names = [f.name for f in fields(Config)]
        if unknown := set(kwargs) - set(names):
            raise ValueError(f"unknown LLM settings {sorted(unknown)}; the settings are the "
                             f"fields of nanoserve.config.Config: {names}")
        self.config = cfg = Config(model or default_model_dir(), **kwargs)
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model)
        # ranks 1..N-1 in their own processes
        self.workers = Workers(cfg, ModelRunner) if cfg.tensor_parallel_size > 1 else None
        self.model_runner: ModelRunner | None = None
        atexit.register(self.shutdown)
        try:  # a model runner that fails to start: the workers already started stop
            self.model_runner = ModelRunner(cfg, workers=self.workers)
        except BaseException:
            self.shutdown()
            raise
        self.scheduler = Scheduler(cfg, self._eos_token_ids())
        self.streams: dict[int, TextStream] = {}  # seq_id -> its text, for streams and stops
        self.loop = None  # the step loop: None for step()'s plain one
        self.observers: list[StepObserver] = []  # a step's outputs
        self.extensions: dict[str, object] = {}  # name -> what its attach() returned
        self.timeline = None  # with timeline=True, the record of every step
        self.num_sampled = 0  # tokens sampled since start-up
        # overlap on one rank only: TP workers never see the sampled tokens, and rank 0's wait
        # for them is also what tells it the workers have read a call before the next one
        for name, on in (("overlap", cfg.overlap_scheduling and self.workers is None),
                         ("speculative", cfg.speculative_method), ("trace", cfg.trace),
                         ("timeline", cfg.timeline), ("prefill_graphs", cfg.prefill_graphs
                                                      and self.model_runner.graphs is not None)):
            if on:
                self._attach(name)
        # The model, compiled kernels and blocks live as long as the engine. Frozen, they are left
        # out of Python's full garbage collections, which scan every object alive and pause the
        # engine while they do (docs/performance.md); shutdown unfreezes them.
        gc.collect()
        gc.freeze()

    def _attach(self, name: str) -> None:
        """Import extension `name` (ValueError if it is missing) and let it attach itself."""
        if name not in self.extensions:
            self.extensions[name] = extension(name).attach(self)

    def _eos_token_ids(self) -> set[int]:
        ids = [self.config.hf_config.eos_token_id, self.tokenizer.eos_token_id]
        with suppress(OSError):  # no generation_config.json
            ids.append(GenerationConfig.from_pretrained(self.config.model).eos_token_id)
        # each is one id, a list of ids, or None
        return {j for i in ids for j in (i if isinstance(i, list) else [i]) if j is not None}

    def _check_running(self) -> None:
        if self.model_runner is None:
            raise RuntimeError("this engine was shut down: create a new LLM")

    # ---- requests -----------------------------------------------------------------------------
    def make_sequence(self, prompt: str | list[int], params: SamplingParams) -> Sequence:
        """Tokenize and validate one request; raise ValueError naming the fix, changing nothing."""
        self._check_running()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        for field, name in REQUEST_EXTENSIONS.items():
            if getattr(params, field) != SamplingParams.__dataclass_fields__[field].default:
                self._attach(name)
        if not isinstance(prompt, (str, list, tuple, np.ndarray)):
            raise ValueError("a prompt must be a string or a list of token ids, got "
                             f"{type(prompt).__name__}")
        # a numpy array's tolist() gives Python ints at C speed (list() gives numpy scalars)
        token_ids = (self.tokenizer.encode(prompt) if isinstance(prompt, str) else
                     prompt.tolist() if isinstance(prompt, np.ndarray) else list(prompt))
        if not token_ids:
            raise ValueError("empty prompt: give at least one token")
        # set(map(type, ...)), min and max loop in C: a per-token isinstance is ten times slower
        types = set(map(type, token_ids))  # numpy integers are welcome; floats, bools not
        if not all(issubclass(t, numbers.Integral) and t is not bool for t in types):
            raise ValueError(f"token ids must be integers, got {sorted(t.__name__ for t in types)}")
        token_ids = list(map(int, token_ids)) if types != {int} else token_ids
        if not 0 <= min(token_ids) <= max(token_ids) < self.config.hf_config.vocab_size:
            raise ValueError(f"token ids {min(token_ids)}..{max(token_ids)} reach outside the "
                             f"vocabulary [0, {self.config.hf_config.vocab_size})")
        if len(token_ids) + params.max_tokens > self.config.max_model_len:
            raise ValueError(f"prompt of {len(token_ids)} tokens + max_tokens={params.max_tokens} "
                             f"exceeds max_model_len={self.config.max_model_len}: shorten the "
                             "prompt, lower max_tokens or raise max_model_len")
        return Sequence(token_ids, params, self.config.kvcache_block_size)

    def add_request(self, prompt: str | list[int], params: SamplingParams,
                    stream: bool = False) -> Sequence:
        """Queue one request; it joins the running batch at the next step. stream=True: each
        stream_step() reports what it added to the request (a RequestOutput)."""
        seq = self.make_sequence(prompt, params)
        self._follow_text(seq, stream)
        self.scheduler.add(seq)
        return seq

    def _follow_text(self, seq: Sequence, streamed: bool) -> None:
        """Decode seq's text step by step when it is streamed or has stop strings, which are
        matched on the text as it grows; otherwise it is decoded once, when it finishes."""
        if seq.params.stop:
            self.streams[seq.seq_id] = self.extensions["stop_strings"].stream(seq, streamed)
        elif streamed:
            self.streams[seq.seq_id] = TextStream(self.tokenizer, streamed)

    def abort_request(self, seq: Sequence) -> None:
        """Finish a request now (its client went away): its blocks are free at once."""
        self._check_running()
        self.scheduler.abort([seq])
        self.streams.pop(seq.seq_id, None)
        for observer in self.observers:
            observer.on_abort(seq)

    def has_unfinished(self) -> bool:
        self._check_running()
        return self.scheduler.has_unfinished()

    def stream_step(self) -> list[RequestOutput]:
        """Run one step (none when idle); return what it added to each streamed request."""
        _, batch = self.step() if self.has_unfinished() else ([], Batch.decode([]))
        return [out for seq in batch.seqs if (out := self._stream_output(seq)) is not None]

    def stream(self, prompt: str | list[int],
               params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Generate for one prompt, yielding its new text and tokens step by step. (Requests of
        several clients share steps through add_request + stream_step, as the server does.)"""
        seq = self.add_request(prompt, params or SamplingParams(), stream=True)
        try:
            while not seq.is_finished:
                yield from (out for out in self.stream_step() if out.request_id == seq.seq_id)
        finally:
            if self.model_runner is not None:
                self.abort_request(seq)  # a consumer that stops early frees the blocks

    def step(self) -> tuple[list[Sequence], Batch]:
        """Run one batch and record its tokens; return the sequences that finished and the batch."""
        self._check_running()
        if self.loop is not None:  # an extension's loop: the same calls in another order
            finished, batch = self.loop.step()
        else:
            batch = self.scheduler.schedule()
            try:
                out = self.model_runner.run(batch)
                token_ids = out.tolist()
            except BaseException:
                self.scheduler.cancel(batch)  # its prompts wait again
                raise
            finished = self.postprocess(batch, out, token_ids)
        for observer in self.observers:
            finished += observer.after_step(batch, finished)
        return finished, batch

    def postprocess(self, batch: Batch, out: StepOutput, token_ids: list[int]) -> list[Sequence]:
        """Hand a step's tokens to the observers, then to the scheduler; return the finished."""
        for observer in self.observers:
            observer.on_tokens(batch, out, token_ids)
        self.num_sampled += len(token_ids)  # for the progress bar (a prompt's chunks count too)
        return self.scheduler.postprocess(batch, token_ids)

    def _stream_output(self, seq: Sequence) -> RequestOutput | None:
        """What the last step added to a streamed request, or None (nothing, or not streamed)."""
        if (text := self.streams.get(seq.seq_id)) is None or not text.streamed:
            return None
        start, end = text.num_sent_tokens, seq.num_output_tokens  # the new tokens: [start, end)
        if start == end and not seq.is_finished:
            return None
        text.update(seq.output_token_ids, seq.is_finished)
        text.num_sent_tokens = end
        if seq.is_finished:
            del self.streams[seq.seq_id]
        logprobs = seq.logprobs[start:end] if seq.params.logprobs is not None else None
        return RequestOutput(seq.seq_id, text.delta(seq.is_finished), seq.output_token_ids[start:],
                             logprobs, seq.finish_reason, seq.num_prompt_tokens,
                             seq.num_cached_tokens, seq.num_output_tokens)

    # ---- the whole loop -----------------------------------------------------------------------
    def generate(self, prompts: list[str] | list[list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[dict]:
        """Generate for every prompt; outputs in prompt order: {"text", "token_ids",
        "finish_reason", "num_cached_tokens"}."""
        self._check_running()
        if not isinstance(prompts, (list, tuple)) or (prompts and isinstance(prompts[0], int)):
            raise ValueError("prompts must be a list of prompts (strings or token-id lists): wrap "
                             "a single prompt in a list")
        params = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts: give "
                             "one per prompt, or a single SamplingParams for all")
        seqs = [self.make_sequence(p, sp) for p, sp in zip(prompts, params)]  # check all
        for seq in seqs:
            self._follow_text(seq, streamed=False)
        try:
            return self._run_to_completion(seqs, use_tqdm)
        except BaseException:
            self.scheduler.abort(seqs)  # drop this call's unfinished requests, free their blocks
            raise
        finally:
            for seq in seqs:
                self.streams.pop(seq.seq_id, None)

    def _run_to_completion(self, seqs: list[Sequence], use_tqdm: bool) -> list[dict]:
        """Step until every one of seqs finishes; their outputs in order, each text decoded as
        its sequence finishes (while the GPU already runs the next step, with overlap)."""
        texts: dict[int, str] = {}
        self.scheduler.add(*seqs)
        # no terminal (a log file): drawn once, at the end; redraws would split the trace's lines
        bar = tqdm(total=len(seqs), desc="Generating", disable=not use_tqdm, dynamic_ncols=True,
                   delay=0 if sys.stderr.isatty() else float("inf"))
        ids = {seq.seq_id for seq in seqs}  # other requests (add_request) may finish in between
        start, first = time.perf_counter(), self.num_sampled
        try:
            while len(texts) < len(seqs):  # each sequence finishes once
                finished, batch = self.step()
                rate = (self.num_sampled - first) / (time.perf_counter() - start)
                # a step loop may add figures of its own (speculation: its acceptance)
                bar.set_postfix_str(f"{rate:,.0f} tokens/s{getattr(self.loop, 'progress', '')}",
                                    refresh=False)
                for seq in (seq for seq in finished if seq.seq_id in ids):
                    text = self.streams.get(seq.seq_id)  # with stop strings: cut there
                    texts[seq.seq_id] = text.text if text is not None else self.tokenizer.decode(
                        seq.output_token_ids, skip_special_tokens=True)
                    bar.update(1)
            if self.loop is not None:
                self.loop.finish()  # a step launched for sequences that turned out finished
        finally:
            if self.loop is not None:
                self.loop.cancel()  # after a failure: drop the step in flight
            if use_tqdm and not sys.stderr.isatty():  # a log file: the bar's one line
                print(bar, file=sys.stderr)
            bar.close()
        return [{"text": texts[seq.seq_id], "token_ids": seq.output_token_ids,
                 "finish_reason": seq.finish_reason, "num_cached_tokens": seq.num_cached_tokens}
                | ({"logprobs": seq.logprobs} if seq.params.logprobs is not None else {})
                for seq in seqs]

    # ---- lifetime -----------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop every worker and free shared memory; safe to call twice, also after a failure."""
        try:
            if self.model_runner is not None:
                self.model_runner.shutdown()
        finally:
            self.model_runner = None
            if self.workers is not None:
                self.workers.shutdown()
                self.workers = None
            atexit.unregister(self.shutdown)
            gc.unfreeze()  # back into the oldest generation: collectable again

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


LLM = LLMEngine
