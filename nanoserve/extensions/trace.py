"""The trace: one log line per engine step (`trace=True` or NANOSERVE_TRACE=1).

Each line says what the step was (prefill or decode, sequences, tokens, milliseconds since the
last line) and what it did to the KV blocks (allocated, freed, prefix-cache hits), preemptions
and finished requests. Reads only extensions.stats, the read-only view the timeline and the
server's metrics share. An Extension: after_step writes the line.
"""
import logging
import sys
import time

from tqdm.contrib import DummyTqdmFile

from nanoserve.extensions.stats import scheduler_stats
from nanoserve.llm_engine import LLMEngine
from nanoserve.model_runner import Extension
from nanoserve.scheduler import Batch
from nanoserve.sequence import Sequence

logger = logging.getLogger("nanoserve")


class Trace(Extension):
    def __init__(self, engine: LLMEngine) -> None:
        """Let the trace through without the program configuring logging (switched on after
        start-up, it skips start-up's INFO lines): the `nanoserve` logger passes INFO unless the
        program set its level, and prints to stderr unless a handler of the program's (or
        pytest's) would already print it."""
        logger.setLevel(logger.level or logging.INFO)  # NOTSET (0): INFO
        if not logger.hasHandlers():  # in a log file, line by line; on a terminal through
            # tqdm.write, which clears a progress bar's line first and draws the bar again below
            stream = DummyTqdmFile(sys.stderr) if sys.stderr.isatty() else None
            handler = logging.StreamHandler(stream)
            handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
            logger.addHandler(handler)
        super().__init__(engine)
        self.last, self.last_time = scheduler_stats(engine.scheduler), time.perf_counter()

    def after_step(self, batch: Batch, finished: list[Sequence]) -> None:
        now, stats = time.perf_counter(), scheduler_stats(self.engine.scheduler)
        # this step's counts: the differences of the counters (num_preemptions and after)
        d = type(stats)(*(new - old for new, old in zip(stats, self.last)))
        logger.info(f"{'prefill' if batch.is_prefill else 'decode':7s} seqs={len(batch.seqs):<3d} "
                    f"tokens={sum(batch.num_new_tokens):<5d} {(now - self.last_time) * 1e3:6.1f} ms"
                    f" | blocks: +{d.num_allocated} allocated -{d.num_freed} freed {d.num_hits} "
                    f"hit | preempted={d.num_preemptions} finished={len(finished)} "
                    f"free={stats.num_free_blocks}/{stats.num_blocks}"  # and the loop's figures:
                    + ("" if batch.is_prefill else self.engine.loop.progress))
        self.last, self.last_time = stats, now

