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
        unknown = set(kwargs) - {f.name for f in fields(Config)}
        if unknown:
            names = [f.name for f in fields(Config)]
            raise ValueError(f"unknown LLM settings {sorted(unknown)}; the settings are the "
                             f"fields of nanoserve.config.Config: {names}")
        self.config = Config(model or default_model_dir(), **kwargs)
        self.tokenizer = AutoTokenizer.from_pretrained(self.config.model)
        self.workers: Workers | None = None
        self.model_runner: ModelRunner | None = None
        atexit.register(self.shutdown)
        try:
            if self.config.tensor_parallel_size > 1:  # ranks 1..N-1 in their own processes
                self.workers = Workers(self.config)
                self.model_runner = ModelRunner(self.config, 0, self.workers.port, self.workers)
            else:
                self.model_runner = ModelRunner(self.config)
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
        try:
            gen = GenerationConfig.from_pretrained(self.config.model).eos_token_id
            ids |= set(gen) if isinstance(gen, list) else {gen}
        except OSError:
            pass  # no generation_config.json
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
        vocab = self.config.hf_config.vocab_size
        # set(map(type, ...)), min and max loop in C: a per-token isinstance is ten times slower
        if set(map(type, token_ids)) != {int}:  # numpy integers are welcome; floats, bools not
            if not all(isinstance(t, numbers.Integral) and not isinstance(t, bool)
                       for t in token_ids):
                names = sorted({type(t).__name__ for t in token_ids})
                raise ValueError(f"token ids must be integers, got {names}")
            token_ids = [int(t) for t in token_ids]
        if not 0 <= min(token_ids) <= max(token_ids) < vocab:
            raise ValueError(f"token ids {min(token_ids)}..{max(token_ids)} reach outside the "
                             f"vocabulary [0, {vocab})")
        limit = self.config.max_model_len
        if len(token_ids) + params.max_tokens > limit:
            raise ValueError(f"prompt of {len(token_ids)} tokens + max_tokens={params.max_tokens} "
                             f"exceeds max_model_len={limit}: shorten the prompt, lower max_tokens "
                             "or raise max_model_len")
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
        delta = {k: v - before[k] for k, v in self._counters().items()}
        logger.info("%-7s seqs=%-3d tokens=%-5d blocks: +%d allocated -%d freed %d hit | "
                    "preempted=%d finished=%d free=%d/%d",
                    "prefill" if batch.is_prefill else "decode", len(batch.seqs),
                    sum(batch.num_new_tokens), delta["allocated"], delta["freed"], delta["hit"],
                    delta["preempted"], num_finished, bm.num_free_blocks, len(bm.blocks))

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
        params = params if params is not None else SamplingParams()
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(params_list)} SamplingParams for {len(prompts)} prompts: give "
                             "one per prompt, or a single SamplingParams for all")
        seqs = [self.make_sequence(p, sp) for p, sp in zip(prompts, params_list)]  # check all
        try:
            texts = self._run_to_completion(seqs, use_tqdm)
        except BaseException:
            self.scheduler.abort(seqs)  # drop this call's unfinished requests, free their blocks
            raise
        return [{"text": texts[seq.seq_id], "token_ids": seq.output_token_ids,
                 "finish_reason": seq.finish_reason, "num_cached_tokens": seq.num_cached_tokens}
                for seq in seqs]

    def _run_to_completion(self, seqs: list[Sequence], use_tqdm: bool) -> dict[int, str]:
        """Step until every one of seqs finishes; their texts by seq_id, each decoded as its
        sequence finishes (while the GPU already runs the next step, with overlap)."""
        texts: dict[int, str] = {}
        for seq in seqs:
            self.scheduler.add(seq)
        bar = tqdm(total=len(seqs), desc="Generating", disable=not use_tqdm, dynamic_ncols=True)
        rates = ThroughputMeter()
        pending = {seq.seq_id for seq in seqs}
        try:
            while pending:
                finished, batch = self.step()
                bar.set_postfix_str(rates.update(batch), refresh=False)
                for seq in finished:
                    if seq.seq_id in pending:
                        pending.remove(seq.seq_id)
                        texts[seq.seq_id] = self.tokenizer.decode(seq.output_token_ids,
                                                                  skip_special_tokens=True)
                        bar.update(1)
            if self.overlap is not None:
                self.overlap.finish()  # a step launched for sequences that turned out finished
        finally:
            if self.overlap is not None:
                self.overlap.cancel()  # after a failure: drop the step in flight
            bar.close()
        return texts

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
        self.tokens = {"prefill": 0, "decode": 0}
        self.seconds = {"prefill": 0.0, "decode": 0.0}
        self.last = time.perf_counter()

    def update(self, batch: Batch) -> str:
        now = time.perf_counter()
        kind = "prefill" if batch.is_prefill else "decode"
        self.tokens[kind] += sum(batch.num_new_tokens)
        self.seconds[kind] += now - self.last
        self.last = now
        rate = {k: self.tokens[k] / max(self.seconds[k], 1e-9) for k in self.tokens}
        return f"prefill {rate['prefill']:,.0f} tok/s, decode {rate['decode']:,.0f} tok/s"


LLM = LLMEngine
