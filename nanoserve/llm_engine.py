"""LLMEngine (alias LLM): the public entry point, which drives schedule -> run -> postprocess.

It tokenizes and validates requests, loops until they finish, and returns outputs in prompt order.

Owns: the tokenizer, the request validation (bad input raises before anything is scheduled, and the
engine stays usable), the progress bar and trace, and the tensor-parallel worker processes
(ranks 1..N-1, started with spawn; rank 0 is this process). Does not own: batching policy
(scheduler), tensors (model_runner).
Invariant: after generate() returns or raises, no sequence of that call is left in the scheduler.
"""
import atexit
import os
import logging
import multiprocessing as mp
import multiprocessing.connection
import numbers
import queue
import socket
import time
import traceback
from dataclasses import fields
from multiprocessing.shared_memory import SharedMemory
from uuid import uuid4

import numpy as np
import torch.distributed as dist
from tqdm.auto import tqdm
from transformers import AutoTokenizer, GenerationConfig

from nanoserve.config import Config, SamplingParams
from nanoserve.model_runner import SHM_BYTES, ModelRunner, StepOutput
from nanoserve.scheduler import Batch, Scheduler
from nanoserve.sequence import Sequence
from nanoserve.weights import default_model_dir

logger = logging.getLogger("nanoserve")
WORKER_JOIN_SECONDS = 5  # how long shutdown waits for a worker before killing it
WORKER_ERROR_WAIT_SECONDS = 0.5  # how long a failure waits for the workers' own error reports


def free_port() -> int:
    """A TCP port nobody listens on, so every engine gets its own rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_main(config: Config, rank: int, shm_name: str, wakeup, port: int, errors: mp.Queue) -> None:
    """Entry point of TP ranks 1..N-1: build the same model shard, then serve rank 0's calls."""
    # a daemon process may not start children, and torch.compile's parallel compile pool is one:
    # compile in this process instead (pytorch/pytorch#97992, #115366: failures and hangs at exit).
    # Imported here, not at the top: it costs ~2 s, and only workers need it.
    import torch._inductor.config
    torch._inductor.config.compile_threads = 1
    try:
        runner = ModelRunner(config, rank, shm_name, [wakeup], port)
        runner.worker_loop()
        runner.shutdown()
    except BaseException:  # report any failure to rank 0 instead of dying silently
        errors.put(f"rank {rank}: {traceback.format_exc()}")
        errors.close()
        errors.join_thread()  # the report is in the pipe now
        os._exit(1)  # skip atexit hooks (torch.compile's worker pool can block there): rank 0 sees us die


class LLMEngine:
    def __init__(self, model: str | None = None, **kwargs) -> None:
        unknown = set(kwargs) - {f.name for f in fields(Config)}
        if unknown:
            raise ValueError(f"unknown LLM settings {sorted(unknown)}; the settings are the fields of "
                             f"nanoserve.config.Config: {[f.name for f in fields(Config)]}")
        self.config = Config(model or default_model_dir(), **kwargs)
        self.tokenizer = AutoTokenizer.from_pretrained(self.config.model)
        self.workers: list[mp.Process] = []
        self.shm: SharedMemory | None = None
        self.model_runner: ModelRunner | None = None
        atexit.register(self.shutdown)
        try:
            self.model_runner = self._start_ranks()
        except BaseException:
            self.shutdown()
            raise
        self.scheduler = Scheduler(self.config, self._eos_token_ids())
        # only a single rank schedules steps ahead: TP workers never see the sampled tokens, and rank 0's wait
        # for them is also what tells it the workers have read a call before the next one overwrites it
        self.overlap = self.config.overlap_scheduling and self.config.tensor_parallel_size == 1
        self.ahead: tuple[Batch, StepOutput] | None = None  # a step launched before the previous one's tokens

    def _start_ranks(self) -> ModelRunner:
        """Start workers for ranks 1..N-1 (spawn), then rank 0's runner here; all join one process group."""
        tp = self.config.tensor_parallel_size
        if tp == 1:
            return ModelRunner(self.config)
        if dist.is_initialized():
            raise RuntimeError("this process already runs a tensor-parallel engine (torch.distributed allows one "
                               "process group per process): shut it down first, or start this one in another process")
        ctx = mp.get_context("spawn")
        self.shm = SharedMemory(name=f"nanoserve-{uuid4().hex[:16]}", create=True, size=SHM_BYTES)
        self.worker_errors = ctx.Queue()
        port, wakeups = free_port(), [ctx.Semaphore(0) for _ in range(1, tp)]
        for rank, wakeup in enumerate(wakeups, start=1):
            proc = ctx.Process(target=worker_main, daemon=True,
                               args=(self.config, rank, self.shm.name, wakeup, port, self.worker_errors))
            proc.start()
            self.workers.append(proc)
        return ModelRunner(self.config, 0, self.shm.name, wakeups, port, self.check_workers)

    def check_workers(self, wait_seconds: float = 0.0) -> None:
        """Raise a RuntimeError carrying the workers' errors if any worker died (rank 0 calls it each step).
        wait_seconds: after a broken collective a peer is dying but may not be reaped yet, so wait for it."""
        if wait_seconds:
            exited = mp.connection.wait([p.sentinel for p in self.workers], timeout=wait_seconds)
            for p in self.workers:
                if p.sentinel in exited:
                    p.join(WORKER_JOIN_SECONDS)  # the sentinel closes just before the exit can be reaped
        dead = [(rank, p) for rank, p in enumerate(self.workers, start=1) if not p.is_alive()]
        if not dead:
            return
        lines = [f"rank {rank} (pid {p.pid}) exited with code {p.exitcode}" for rank, p in dead]
        while True:  # what the workers reported before exiting; a SIGKILLed one reports nothing
            try:
                lines.append(self.worker_errors.get(timeout=WORKER_ERROR_WAIT_SECONDS))
            except queue.Empty:
                break
        raise RuntimeError("a tensor-parallel worker failed; shut this engine down and start a new one.\n"
                           + "\n".join(lines))

    def _eos_token_ids(self) -> set[int]:
        ids = {self.config.hf_config.eos_token_id, self.tokenizer.eos_token_id}
        try:
            gen = GenerationConfig.from_pretrained(self.config.model).eos_token_id
            ids |= set(gen) if isinstance(gen, list) else {gen}
        except OSError:
            pass  # no generation_config.json
        return {i for i in ids if i is not None}

    # ---- requests ---------------------------------------------------------------------------------
    def make_sequence(self, prompt: str | list[int], params: SamplingParams) -> Sequence:
        """Tokenize and validate one request; raise ValueError naming the fix, changing nothing."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        # a numpy array's tolist() gives Python ints at C speed; list() would give numpy scalars (the slow path)
        token_ids = (self.tokenizer.encode(prompt) if isinstance(prompt, str) else
                     prompt.tolist() if isinstance(prompt, np.ndarray) else list(prompt))
        if not token_ids:
            raise ValueError("empty prompt: give at least one token")
        vocab = self.config.hf_config.vocab_size
        # set(map(...)), min and max loop in C: W2's 256 prompts of ~1,100 tokens check in ~25 ms on 2 slow
        # cores, against 258 ms for an isinstance(t, numbers.Integral) per token
        if set(map(type, token_ids)) != {int}:  # numpy integers are welcome (Integral); floats, bools are not
            if not all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in token_ids):
                raise ValueError(f"token ids must be integers, got {sorted({type(t).__name__ for t in token_ids})}")
            token_ids = [int(t) for t in token_ids]
        if not 0 <= min(token_ids) <= max(token_ids) < vocab:
            raise ValueError(f"token ids {min(token_ids)}..{max(token_ids)} reach outside the vocabulary [0, {vocab})")
        limit = self.config.max_model_len
        if len(token_ids) + params.max_tokens > limit:
            raise ValueError(f"prompt of {len(token_ids)} tokens + max_tokens={params.max_tokens} exceeds "
                             f"max_model_len={limit}: shorten the prompt, lower max_tokens or raise max_model_len")
        return Sequence(token_ids, params, self.config.kvcache_block_size)

    def add_request(self, prompt: str | list[int], params: SamplingParams) -> Sequence:
        seq = self.make_sequence(prompt, params)
        self.scheduler.add(seq)
        return seq

    def step(self) -> tuple[list[Sequence], Batch]:
        """Run one batch and record its tokens; return the sequences that finished, and the batch.

        Overlap: while a step runs on the GPU, the next one (a decode after a decode, a prefill after a
        prefill) is scheduled, prepared and launched (scheduler.schedule_ahead), and only then does the host
        wait for this step's tokens. So the GPU does not idle on the host between such steps."""
        if self.config.trace:  # block counts of this call: with overlap, those of the step scheduled ahead too
            stats_before = self._counters()
        if self.ahead is not None:
            (batch, out), self.ahead = self.ahead, None
        else:
            batch, out = self.scheduler.schedule(), None
        nxt = None
        try:
            if out is None:
                out = self.model_runner.run(batch)
            nxt = self.scheduler.schedule_ahead(batch) if self.overlap else None
            if nxt is not None:
                self.ahead = (nxt, self.model_runner.run(nxt, prev=None if nxt.is_prefill else (batch, out)))
            finished = self.scheduler.postprocess(batch, out.tolist())
        except BaseException:  # neither step will be postprocessed: prompts wait again, PENDING tokens go
            for cancelled in (nxt, batch):  # the later one first, so the prompts keep their order
                if cancelled is not None:
                    self.scheduler.cancel(cancelled)
            self.ahead = None
            raise
        if self.config.trace:
            self._trace(batch, stats_before, len(finished))
        return finished, batch

    def _counters(self) -> dict[str, int]:
        """Running counts of blocks allocated, freed and hit, and of preemptions; the trace prints their deltas."""
        return dict(self.scheduler.block_manager.stats, preempted=self.scheduler.num_preemptions)

    def _trace(self, batch: Batch, before: dict[str, int], num_finished: int) -> None:
        bm = self.scheduler.block_manager
        now = self._counters()
        delta = {k: now[k] - before[k] for k in before}
        logger.info("%-7s seqs=%-3d tokens=%-5d blocks: +%d allocated -%d freed %d hit | preempted=%d "
                    "finished=%d free=%d/%d", "prefill" if batch.is_prefill else "decode", len(batch.seqs),
                    sum(batch.num_new_tokens), delta["allocated"], delta["freed"], delta["hit"],
                    delta["preempted"], num_finished, bm.num_free_blocks, len(bm.blocks))

    # ---- the whole loop -----------------------------------------------------------------------------
    def generate(self, prompts: list[str] | list[list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None, use_tqdm: bool = True) -> list[dict]:
        """Generate for every prompt; outputs in prompt order: {"text", "token_ids", "finish_reason"}."""
        if self.model_runner is None:
            raise RuntimeError("this engine was shut down: create a new LLM")
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            raise ValueError("prompts must be a list of prompts: wrap a single prompt in a list")
        params = params if params is not None else SamplingParams()
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(params_list)} SamplingParams for {len(prompts)} prompts: give one per "
                             "prompt, or a single SamplingParams for all")
        seqs = [self.make_sequence(p, sp) for p, sp in zip(prompts, params_list)]  # validate all first
        try:
            texts = self._run_to_completion(seqs, use_tqdm)
        except BaseException:
            self.scheduler.abort(seqs)  # a failure: drop this call's unfinished requests, free their blocks
            raise
        return [{"text": texts[seq.seq_id], "token_ids": seq.output_token_ids, "finish_reason": seq.finish_reason}
                for seq in seqs]

    def _run_to_completion(self, seqs: list[Sequence], use_tqdm: bool) -> dict[int, str]:
        """Step until every one of seqs finishes; returns their texts by seq_id, each decoded as its sequence
        finishes, while the GPU already runs the step after (with overlap), not all at the end."""
        texts: dict[int, str] = {}
        for seq in seqs:
            self.scheduler.add(seq)
        bar = tqdm(total=len(seqs), desc="Generating", disable=not use_tqdm, dynamic_ncols=True)
        tok_s = {"prefill": 0.0, "decode": 0.0}
        pending = set(seq.seq_id for seq in seqs)
        t = time.perf_counter()
        try:
            while pending:
                finished, batch = self.step()
                kind = "prefill" if batch.is_prefill else "decode"
                # over the whole loop turn: with overlap, step() itself may return at once (its tokens were ready)
                tok_s[kind] = sum(batch.num_new_tokens) / max(time.perf_counter() - t, 1e-9)
                t = time.perf_counter()
                bar.set_postfix_str(f"prefill {tok_s['prefill']:,.0f} tok/s, decode {tok_s['decode']:,.0f} tok/s",
                                    refresh=False)
                for seq in finished:
                    if seq.seq_id in pending:
                        pending.remove(seq.seq_id)
                        texts[seq.seq_id] = self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
                        bar.update(1)
            if self.ahead is not None:  # a step launched for sequences that turned out finished (EOS)
                (batch, out), self.ahead = self.ahead, None
                self.scheduler.postprocess(batch, out.tolist())
        finally:
            if self.ahead is not None:  # a failure: generate() aborts its sequences; others drop the step
                self.scheduler.cancel(self.ahead[0])
                self.ahead = None
            bar.close()
        return texts

    # ---- lifetime -----------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop every worker and free shared memory; safe to call twice, also after a failure."""
        if self.model_runner is not None:
            try:
                self.model_runner.shutdown()
            finally:
                self.model_runner = None
        for proc in self.workers:
            proc.join(WORKER_JOIN_SECONDS)
            if proc.is_alive():
                proc.kill()
                proc.join()
        self.workers = []
        if self.shm is not None:
            self.shm.close()
            self.shm.unlink()
            self.shm = None
        atexit.unregister(self.shutdown)

    def __enter__(self) -> "LLMEngine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


LLM = LLMEngine
