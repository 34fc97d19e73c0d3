"""LLMEngine (alias LLM): the public entry point, which drives schedule -> run -> postprocess.

It tokenizes and validates requests, loops until they finish, and returns outputs in prompt order.
Owns: the tokenizer, request validation (bad input raises before anything is scheduled, and the
engine stays usable), the engine loop, streaming text and the progress bar.
Extension points, three, each declared here or in the model runner (nanoserve/extensions/):
- Extensions (model_runner.Extension): hooks at fixed points of a step and a request, called in
  the order of `self.extensions`; `switch_on` is the one way one joins, whether a setting or a
  request field asks (EXTENSIONS says which and in what order);
- the step loop (`StepLoop`: step, finish, cancel, progress, counts), composed by `_make_loop`;
- the backends and the graph runner, chosen by the model runner when it is built.
Does not own: batching policy (scheduler), tensors (model_runner), worker processes (distributed).
Invariant: after generate() returns or raises, no sequence of that call is left in the scheduler.
"""
import atexit
import gc
import numbers
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, suppress
from dataclasses import dataclass, fields

import numpy as np
from tqdm.auto import tqdm
from transformers import AutoTokenizer, GenerationConfig, PreTrainedTokenizerBase

from nanoserve.config import Config, SamplingParams, extension
from nanoserve.distributed import Workers
from nanoserve.model_runner import Extension, ModelRunner, StepOutput
from nanoserve.scheduler import Batch, Scheduler
from nanoserve.sequence import Sequence, TextStream
from nanoserve.weights import default_model_dir

# the Extensions: module in nanoserve/extensions/ -> its class, in the order their hooks run
# (guided masks the logits before top-k/p chooses among them)
EXTENSIONS = dict(guided="Guided", top_k_top_p="TopKTopP", logprobs="Logprobs",
                  stop_strings="StopStrings", trace="Trace", timeline="Timeline", samples="Samples")
# SamplingParams fields that switch an Extension on when not at their default: field -> module
REQUEST_EXTENSIONS = {"stop": "stop_strings", "logprobs": "logprobs", "top_k": "top_k_top_p",
                      "top_p": "top_k_top_p", "guided_decoding": "guided"}


def eos_token_ids(config: Config, tokenizer: PreTrainedTokenizerBase) -> set[int]:
    """The tokens that end a sequence: the model's, the tokenizer's and the generation config's."""
    ids = [config.hf_config.eos_token_id, tokenizer.eos_token_id]
    with suppress(OSError):  # no generation_config.json
        ids.append(GenerationConfig.from_pretrained(config.model).eos_token_id)
    # each is one id, a list of ids, or None
    return {j for i in ids for j in (i if isinstance(i, list) else [i]) if j is not None}


class StepLoop:
    """The step loop's verbs, and the plain loop: schedule a batch, run it, wait for its tokens,
    record them; each step after the one before. An extension's loop (overlap scheduling,
    speculative decoding) keeps the verbs and runs the same calls in another order."""
    progress = ""  # the loop's own figures, for the progress bar and the trace (none here)

    def __init__(self, scheduler: Scheduler, model_runner: ModelRunner,
                 postprocess: Callable[[Batch, StepOutput, list[int]], list[Sequence]]) -> None:
        """postprocess: records a step's tokens (LLMEngine.postprocess)."""
        self.scheduler, self.model_runner, self.postprocess = scheduler, model_runner, postprocess

    def step(self) -> tuple[list[Sequence], Batch]:
        """Run one batch and record its tokens; return the sequences that finished and the batch."""
        batch = self.scheduler.schedule()
        try:
            out = self.model_runner.run(batch)
            token_ids = out.tolist()
        except BaseException:
            self.scheduler.cancel(batch)  # its prompts wait again
            raise
        return self.postprocess(batch, out, token_ids), batch

    def finish(self) -> tuple[list[Sequence], Batch] | None:
        """Record the step still in flight, if any, and return it as step() does (none here)."""

    def cancel(self) -> None:
        """Drop the step still in flight, if any, after a failure (none here)."""

    def counts(self, seq: Sequence | None = None) -> dict[str, int]:
        """The loop's own counts, for one request or since start-up (none here)."""
        return {}


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


class LLMEngine(AbstractContextManager):  # `with LLM(...) as llm:` shuts it down at the end
    def __init__(self, model: str | None = None, **kwargs) -> None:
        names = [f.name for f in fields(Config)]
        if unknown := set(kwargs) - set(names):
            raise ValueError(f"unknown LLM settings {sorted(unknown)}; the settings are the "
                             f"fields of nanoserve.config.Config: {names}")
        self.config = cfg = Config(model or default_model_dir(), **kwargs)
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model)
        # ranks 1..N-1, each in a process of its own
        self.workers = Workers(cfg, ModelRunner) if cfg.tensor_parallel_size > 1 else None
        self.model_runner: ModelRunner | None = None
        self.extensions: list[Extension] = []  # in EXTENSIONS' order; the model runner's too
        self.switched_on: dict[str, Extension] = {}  # module -> its Extension, for switch_on
        atexit.register(self.shutdown)
        try:  # an engine that fails to start (a bad setting, say) frees its GPU and workers now
            self.model_runner = ModelRunner(cfg, workers=self.workers, extensions=self.extensions)
            self.scheduler = Scheduler(cfg, eos_token_ids(cfg, self.tokenizer))
            self.streams: dict[int, TextStream] = {}  # seq_id -> its text, for streams and stops
            self.num_sampled = 0  # tokens sampled since start-up
            self.loop = self._make_loop()
            self.trace = self.switch_on("trace") if cfg.trace else None  # one log line a step
            self.timeline = self.switch_on("timeline") if cfg.timeline else None  # all steps
        except BaseException:
            self.shutdown()
            raise
        # The model, compiled kernels and blocks live as long as the engine. Frozen, they are left
        # out of Python's full garbage collections, which scan every object alive and pause the
        # engine while they do (docs/performance.md); shutdown unfreezes them.
        gc.collect()
        gc.freeze()

    def switch_on(self, name: str) -> Extension:
        """The one way an Extension joins the engine, whether a setting or a request field asks:
        import module `name` (ValueError if it is missing), build its Extension once, and place it
        in self.extensions by EXTENSIONS' order (before any the program added). Returns it."""
        if name not in self.switched_on:
            self.switched_on[name] = ext = getattr(extension(name), EXTENSIONS[name])(self)
            order = sorted(self.switched_on, key=list(EXTENSIONS).index)
            self.extensions.insert(order.index(name), ext)
        return self.switched_on[name]

    def _make_loop(self) -> StepLoop:
        """The step loop, composed here once: the plain loop, or overlap's on one rank (TP
        workers never see the sampled tokens, and rank 0's wait for them is also what tells it
        the workers have read a call before the next one); speculation's on top of either, which
        runs its steps without drafts."""
        cfg, parts = self.config, (self.scheduler, self.model_runner, self.postprocess)
        overlap = cfg.overlap_scheduling and self.workers is None
        loop = extension("overlap").OverlapLoop(*parts) if overlap else StepLoop(*parts)
        if cfg.speculative_method:
            loop = extension("speculative").SpeculativeLoop(self, fallback=loop)
        return loop

    def _check_running(self) -> None:
        if self.model_runner is None:
            raise RuntimeError("this engine was shut down: create a new LLM")

    # ---- requests -----------------------------------------------------------------------------
    def make_sequence(self, prompt: str | list[int], params: SamplingParams) -> Sequence:
        """Tokenize and validate one request; raise ValueError naming the fix, changing nothing."""
        self._check_running()
        if not isinstance(params, SamplingParams) or params.n > 1 or params.best_of:
            raise ValueError(f"need one sample's SamplingParams (n > 1: generate()), got {params}")
        for field, name in REQUEST_EXTENSIONS.items():
            if getattr(params, field) != SamplingParams.__dataclass_fields__[field].default:
                self.switch_on(name)
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
        """The extensions see the new request; one may follow its text (stop strings, matched on
        the text as it grows). Otherwise a streamed one is decoded step by step, and any other
        once, when it finishes."""
        texts = [text for ext in self.extensions if (text := ext.on_request(seq, streamed))]
        if texts or streamed:
            self.streams[seq.seq_id] = texts[0] if texts else TextStream(self.tokenizer, streamed)

    def abort_request(self, seq: Sequence) -> None:
        """Finish a request now (its client went away): its blocks are free at once."""
        self._check_running()
        self.scheduler.abort([seq])
        self.streams.pop(seq.seq_id, None)
        for ext in self.extensions:
            ext.on_abort(seq)

    def has_unfinished(self) -> bool:
        self._check_running()
        return self.scheduler.has_unfinished()

    def stream_step(self) -> list[RequestOutput]:
        """Run one step (none when idle); return what it added to each streamed request."""
        batch = self.step()[1] if self.has_unfinished() else Batch.decode([])
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
        finished, batch = self.loop.step()
        for ext in self.extensions:
            ext.after_step(batch, finished)
        return finished, batch

    def postprocess(self, batch: Batch, out: StepOutput, token_ids: list[int]) -> list[Sequence]:
        """Record a step's tokens (the loop calls it; speculation once per round of a step): the
        scheduler records them, then the extensions see them and finish what they stop. Returns
        the finished."""
        self.num_sampled += len(token_ids)  # for the progress bar (a prompt's chunks count too)
        finished = self.scheduler.postprocess(batch, token_ids)
        for ext in self.extensions:
            finished += ext.on_tokens(batch, out, token_ids)
        return finished

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
        "finish_reason", "num_cached_tokens"}, or with SamplingParams(n > 1) a list of n of them
        (extensions.samples)."""
        if not isinstance(prompts, (list, tuple)) or (prompts and isinstance(prompts[0], int)):
            raise ValueError("prompts must be a list of prompts (strings or token-id lists): wrap "
                             "a single prompt in a list")
        params = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts: give "
                             "one per prompt, or a single SamplingParams for all")
        if any(sp.n > 1 or sp.best_of for sp in params if isinstance(sp, SamplingParams)):
            return self.switch_on("samples").generate(prompts, params, use_tqdm)  # fanned out
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
                bar.set_postfix_str(f"{rate:,.0f} tokens/s{self.loop.progress}", refresh=False)
                for seq in (seq for seq in finished if seq.seq_id in ids):
                    text = self.streams.get(seq.seq_id)  # with stop strings: cut there
                    texts[seq.seq_id] = text.text if text is not None else self.tokenizer.decode(
                        seq.output_token_ids, skip_special_tokens=True)
                    bar.update(1)
            self.loop.finish()  # a step launched for sequences that turned out finished
        finally:
            self.loop.cancel()  # after a failure: drop the step in flight
            if use_tqdm and not sys.stderr.isatty():  # a log file: the bar's one line
                print(bar, file=sys.stderr)
            bar.close()
        return [{"text": texts[seq.seq_id], "token_ids": seq.output_token_ids,
                 "finish_reason": seq.finish_reason, "num_cached_tokens": seq.num_cached_tokens}
                | ({"logprobs": seq.logprobs} if seq.params.logprobs is not None else {})
                for seq in seqs]

    def beam_search(self, prompts: list[str] | list[list[int]], params: object) -> list[list[dict]]:
        """Beam search (extensions.samples.BeamSearchParams): per prompt, its beam_width best
        beams, best first: {"text", "token_ids", "cumulative_logprob", "score"}."""
        return self.switch_on("samples").beam_search(prompts, params)

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
