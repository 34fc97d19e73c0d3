"""LLMEngine (alias LLM): the public entry point, which drives schedule -> run -> postprocess.

It tokenizes and validates requests, loops until they finish, and returns outputs in prompt order.
Owns: the tokenizer, request validation (bad input raises before anything is scheduled, and the
engine stays usable), the engine loop, the progress bar and the trace. The loop is plain in
`step()`; with overlap scheduling it is overlap.OverlapLoop's, the same calls in another order.
Does not own: batching policy (scheduler), tensors (model_runner), worker processes (distributed).
Invariant: after generate() returns or raises, no sequence of that call is left in the scheduler.
"""
import atexit
import logging
import numbers
import time
from contextlib import suppress
from dataclasses import fields

import numpy as np
from tqdm.auto import tqdm
from transformers import AutoTokenizer, GenerationConfig

from nanoserve.config import Config, SamplingParams
from nanoserve.distributed import Workers
from nanoserve.model_runner import ModelRunner
from nanoserve.overlap import OverlapLoop
from nanoserve.scheduler import Batch, Scheduler
from nanoserve.sequence import Sequence
from nanoserve.weights import default_model_dir

logger = logging.getLogger("nanoserve")


class LLMEngine:
    def __init__(self, model: str | None = None, **kwargs) -> None:
        names = [f.name for f in fields(Config)]
        if unknown := set(kwargs) - set(names):
            raise ValueError(f"unknown LLM settings {sorted(unknown)}; the settings are the "
                             f"fields of nanoserve.config.Config: {names}")
        self.config = Config(model or default_model_dir(), **kwargs)
        self.tokenizer = AutoTokenizer.from_pretrained(self.config.model)
        # ranks 1..N-1 in their own processes
        self.workers = Workers(self.config) if self.config.tensor_parallel_size > 1 else None
        self.model_runner: ModelRunner | None = None
        atexit.register(self.shutdown)
        try:  # a model runner that fails to start: the workers already started stop
            port = self.workers.port if self.workers is not None else None
            self.model_runner = ModelRunner(self.config, 0, port, self.workers)
        except BaseException:
            self.shutdown()
            raise
        self.scheduler = Scheduler(self.config, self._eos_token_ids())
        # one rank only: TP workers never see the sampled tokens, and rank 0's wait for them is
        # also what tells it the workers have read a call before the next one overwrites it
        self.overlap = (OverlapLoop(self.scheduler, self.model_runner)
                        if self.config.overlap_scheduling and self.workers is None else None)

    def _eos_token_ids(self) -> set[int]:
        ids = {self.config.hf_config.eos_token_id, self.tokenizer.eos_token_id}
        with suppress(OSError):  # no generation_config.json
            gen = GenerationConfig.from_pretrained(self.config.model).eos_token_id
            ids |= set(gen) if isinstance(gen, list) else {gen}
        return {i for i in ids if i is not None}

    # ---- requests -----------------------------------------------------------------------------
    def make_sequence(self, prompt: str | list[int], params: SamplingParams) -> Sequence:
        """Tokenize and validate one request; raise ValueError naming the fix, changing nothing."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
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
            names = sorted({t.__name__ for t in types})
            raise ValueError(f"token ids must be integers, got {names}")
        token_ids = list(map(int, token_ids)) if types != {int} else token_ids
        if not 0 <= min(token_ids) <= max(token_ids) < self.config.hf_config.vocab_size:
            raise ValueError(f"token ids {min(token_ids)}..{max(token_ids)} reach outside the "
                             f"vocabulary [0, {self.config.hf_config.vocab_size})")
        if len(token_ids) + params.max_tokens > self.config.max_model_len:
            raise ValueError(f"prompt of {len(token_ids)} tokens + max_tokens={params.max_tokens} "
                             f"exceeds max_model_len={self.config.max_model_len}: shorten the "
                             "prompt, lower max_tokens or raise max_model_len")
        return Sequence(token_ids, params, self.config.kvcache_block_size)

    def add_request(self, prompt: str | list[int], params: SamplingParams) -> Sequence:
        seq = self.make_sequence(prompt, params)
        self.scheduler.add(seq)
        return seq

    def step(self) -> tuple[list[Sequence], Batch]:
        """Run one batch and record its tokens; return the sequences that finished and the batch."""
        before = self._counters() if self.config.trace else None
        if self.overlap is not None:  # the same three calls, the next step launched first
            finished, batch = self.overlap.step()
        else:
            batch = self.scheduler.schedule()
            try:
                token_ids = self.model_runner.run(batch).tolist()
            except BaseException:
                self.scheduler.cancel(batch)  # its prompts wait again
                raise
            finished = self.scheduler.postprocess(batch, token_ids)
        if before is not None:
            self._trace(batch, before, len(finished))
        return finished, batch

    def _counters(self) -> dict[str, int]:
        """Running counts of blocks allocated, freed and hit, and of preemptions."""
        return dict(self.scheduler.block_manager.stats, preempted=self.scheduler.num_preemptions)

    def _trace(self, batch: Batch, before: dict[str, int], num_finished: int) -> None:
        bm = self.scheduler.block_manager
        d = {k: v - before[k] for k, v in self._counters().items()}  # this step's counts
        logger.info(f"{'prefill' if batch.is_prefill else 'decode':7s} seqs={len(batch.seqs):<3d} "
                    f"tokens={sum(batch.num_new_tokens):<5d} blocks: +{d['allocated']} allocated "
                    f"-{d['freed']} freed {d['hit']} hit | preempted={d['preempted']} "
                    f"finished={num_finished} free={bm.num_free_blocks}/{len(bm.blocks)}")

    # ---- the whole loop -----------------------------------------------------------------------
    def generate(self, prompts: list[str] | list[list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[dict]:
        """Generate for every prompt; outputs in prompt order: {"text", "token_ids",
        "finish_reason", "num_cached_tokens"}."""
        if self.model_runner is None:
            raise RuntimeError("this engine was shut down: create a new LLM")
        if not isinstance(prompts, (list, tuple)) or (prompts and isinstance(prompts[0], int)):
            raise ValueError("prompts must be a list of prompts (strings or token-id lists): wrap "
                             "a single prompt in a list")
        params = SamplingParams() if params is None else params
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(params_list)} SamplingParams for {len(prompts)} prompts: give "
                             "one per prompt, or a single SamplingParams for all")
        seqs = [self.make_sequence(p, sp) for p, sp in zip(prompts, params_list)]  # check all
        try:
            return self._run_to_completion(seqs, use_tqdm)
        except BaseException:
            self.scheduler.abort(seqs)  # drop this call's unfinished requests, free their blocks
            raise

    def _run_to_completion(self, seqs: list[Sequence], use_tqdm: bool) -> list[dict]:
        """Step until every one of seqs finishes; their outputs in order, each text decoded as
        its sequence finishes (while the GPU already runs the next step, with overlap)."""
        texts: dict[int, str] = {}
        self.scheduler.add(*seqs)
        bar = tqdm(total=len(seqs), desc="Generating", disable=not use_tqdm, dynamic_ncols=True)
        rates = ThroughputMeter()
        ids = {seq.seq_id for seq in seqs}  # other requests (add_request) may finish in between
        try:
            while len(texts) < len(seqs):  # each sequence finishes once
                finished, batch = self.step()
                bar.set_postfix_str(rates.update(batch), refresh=False)
                for seq in finished:
                    if seq.seq_id in ids:
                        texts[seq.seq_id] = self.tokenizer.decode(seq.output_token_ids,
                                                                  skip_special_tokens=True)
                        bar.update(1)
            if self.overlap is not None:
                self.overlap.finish()  # a step launched for sequences that turned out finished
        finally:
            if self.overlap is not None:
                self.overlap.cancel()  # after a failure: drop the step in flight
            bar.close()
        return [{"text": texts[seq.seq_id], "token_ids": seq.output_token_ids,
                 "finish_reason": seq.finish_reason, "num_cached_tokens": seq.num_cached_tokens}
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

    def __enter__(self) -> "LLMEngine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


class ThroughputMeter:
    """Prefill and decode tokens/s for the progress bar, each over all the steps of its kind so
    far: a single step's rate means little when, with overlap, a step can return at once."""

    def __init__(self) -> None:
        # [decode, prefill], indexed by batch.is_prefill; the time of the last update
        self.tokens, self.seconds, self.last = [0, 0], [0.0, 0.0], time.perf_counter()

    def update(self, batch: Batch) -> str:
        last, self.last = self.last, time.perf_counter()
        self.tokens[batch.is_prefill] += sum(batch.num_new_tokens)
        self.seconds[batch.is_prefill] += self.last - last
        decode, prefill = (n / max(s, 1e-9) for n, s in zip(self.tokens, self.seconds))
        return f"prefill {prefill:,.0f} tok/s, decode {decode:,.0f} tok/s"


LLM = LLMEngine
