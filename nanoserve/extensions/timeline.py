"""Timeline: what every engine step did to every request, recorded and drawn as one picture.

Owns: the record (a column per step, a row per request: prefill chunks, decodes, preemption and
recompute, prefix-cache hits, the finish; per step: tokens, batch size, KV blocks in use) and its
matplotlib figure. Does not own scheduling: it reads what the scheduler did from host-side state it
already keeps (the batch, the queues, extensions.stats), so recording adds no device sync, and an
engine without `timeline=True` builds none (nor imports this module, or matplotlib). An
Extension: after_step adds a column, on_tokens counts the kept tokens, on_abort ends a row; users
read it as `llm.timeline`:

    llm = LLM(timeline=True)                 # or: python example.py --timeline timeline.png
    llm.generate(prompts, params)
    llm.timeline.plot("timeline.png")

Invariant: column i is the i-th batch postprocessed. With overlap scheduling the step after it is
already scheduled by then, so the blocks that step allocated count as in use in column i.
"""
from dataclasses import dataclass, field
from itertools import islice, takewhile
from pathlib import Path
from typing import NamedTuple

import numpy as np
from matplotlib import colors, figure, patches  # a bare Figure, no pyplot: no global state

from nanoserve.extensions.stats import scheduler_stats
from nanoserve.llm_engine import LLMEngine
from nanoserve.model_runner import Extension
from nanoserve.scheduler import Batch
from nanoserve.sequence import Sequence

# a request's cell in a step (0: none, before it arrived or after it finished). IDLE: running,
# but not in the batch: a prefill step (prompts go first), or a decode already at max_num_seqs
WAITING, CHUNK, PREFILL, RECOMPUTE, DECODE, IDLE, PREEMPTED = range(1, 8)
LEGEND = {WAITING: ("waiting", "#d9d9d9"), CHUNK: ("prefill chunk", "#9ecae1"),
          PREFILL: ("prefill (last chunk)", "#2171b5"), RECOMPUTE: ("recompute", "#fd8d3c"),
          DECODE: ("decode", "#41ab5d"), IDLE: ("running, not in the batch", "#e5f5e0"),
          PREEMPTED: ("preempted", "#cb181d")}


@dataclass
class Row:
    """One request. cells[step] says what that step did to it; the gaps between cells (waiting,
    idle) are not stored but drawn by Timeline.grid."""
    seq_id: int
    num_prompt_tokens: int
    arrival: int  # the first step after which it was in a queue or a batch
    cells: dict[int, int] = field(default_factory=dict)
    hits: dict[int, int] = field(default_factory=dict)  # step -> prompt tokens from prefix cache
    finish: int | None = None  # the step that finished it


class Step(NamedTuple):
    is_prefill: bool
    num_seqs: int  # the batch size
    num_tokens: int  # tokens computed
    num_sampled: int  # tokens the step's rows sampled (speculation: several a sequence)
    num_used_blocks: int  # KV blocks in use after the step
    num_waiting: int  # requests in the waiting queue after the step


class Timeline(Extension):
    """The record: rows (dict[int, Row], by seq_id) and steps (list[Step], one per column)."""

    def __init__(self, engine: LLMEngine) -> None:
        """Records engine's steps from now on (its config, scheduler and num_sampled are read)."""
        super().__init__(engine)
        self.config, self.scheduler, self.rows, self.steps = engine.config, engine.scheduler, {}, []
        # the scheduler's and the engine's running counts as last seen (they may start above 0)
        self.num_preemptions = scheduler_stats(self.scheduler).num_preemptions
        self.num_sampled = engine.num_sampled

    def after_step(self, batch: Batch, finished: list[Sequence]) -> None:
        """Add a column: `batch` was just postprocessed and `finished` ended in it (they are the
        batch's sequences finished now, which is how they are found). Costs O(batch + arrivals +
        preemptions): it never walks the whole queues."""
        step, sched, stats = len(self.steps), self.scheduler, scheduler_stats(self.scheduler)
        for seq in batch.seqs:  # each seen at its first prefill at the latest
            row = self.rows.setdefault(seq.seq_id, Row(seq.seq_id, seq.num_prompt_tokens, step))
            if row.finish is None:  # with overlap, a decode can run one step past a late EOS
                row.cells[step] = self._prefill_cell(row, seq, step) if batch.is_prefill else DECODE
                row.finish = step if seq.is_finished else None  # one of `finished`
        # arrivals: add() appends to `waiting`, and a prefill scheduled ahead (overlap) appends to
        # `running`, so requests not seen yet are at the backs of the queues
        for queue in (sched.waiting, sched.running):
            for seq in takewhile(lambda s: s.seq_id not in self.rows, reversed(queue)):
                self.rows[seq.seq_id] = Row(seq.seq_id, seq.num_prompt_tokens, step)
        # since the last column, only this batch's scheduling preempted (schedule_decode), each
        # sequence to the front of `waiting`
        for seq in islice(sched.waiting, stats.num_preemptions - self.num_preemptions):
            self.rows[seq.seq_id].cells[step] = PREEMPTED
        self.num_preemptions = stats.num_preemptions
        # tokens recorded since the last column (speculation records a step's in rounds)
        kept, self.num_sampled = self.engine.num_sampled - self.num_sampled, self.engine.num_sampled
        self.steps.append(Step(batch.is_prefill, len(batch.seqs), sum(batch.num_new_tokens), kept,
                               stats.num_blocks - stats.num_free_blocks, stats.num_waiting))

    def on_abort(self, seq: Sequence) -> None:
        """A request aborted between steps (LLMEngine.abort_request) ends at the last column."""
        if (row := self.rows.get(seq.seq_id)) is not None and row.finish is None:
            row.finish = max(row.arrival, len(self.steps) - 1)

    def _prefill_cell(self, row: Row, seq: Sequence, step: int) -> int:
        # its first chunk since it arrived or was preempted starts past the cached prefix
        if next(reversed(row.cells.values()), PREEMPTED) == PREEMPTED and seq.num_cached_tokens:
            row.hits[step] = seq.num_cached_tokens
        # a chunk samples nothing; the last chunk samples the first token
        done = seq.num_output_tokens > 0
        return RECOMPUTE if PREEMPTED in row.cells.values() else PREFILL if done else CHUNK

    def grid(self) -> tuple[list[Row], np.ndarray]:
        """The rows in arrival order and their cells as codes (R, T), the gaps filled in: WAITING
        from arrival to the first prefill chunk and from a preemption to the recompute, IDLE
        elsewhere until the finish."""
        rows = sorted(self.rows.values(), key=lambda row: row.seq_id)
        grid = np.zeros((len(rows), len(self.steps)), np.int8)  # (R, T)
        for row, line in zip(rows, grid):  # line: a view of the row's cells, (T,)
            for t in range(row.arrival, len(self.steps) if row.finish is None else row.finish + 1):
                # a gap waits at the arrival and after a wait or a preemption; elsewhere it idles
                gap = WAITING if t == row.arrival or line[t - 1] in (WAITING, PREEMPTED) else IDLE
                line[t] = row.cells.get(t, gap)
        return rows, grid

    def plot(self, path: str | Path) -> figure.Figure:
        """Draw the run and save it to path (the format by its suffix); return the figure. On top
        a cell per request and step, a star on each prefix-cache hit, a bar at each finish; below
        it, per step as stairs: KV blocks in use, tokens (prefill, decode), batch size, waiting."""
        (rows, grid), c = self.grid(), self.config  # grid: (R, T)
        height = min(9.0, max(2.5, 0.3 * len(rows)))  # of the requests' panel, in inches
        fig = figure.Figure(figsize=(13, height + 5), layout="constrained")
        ax, kv, tok, bs = fig.subplots(4, 1, sharex=True, height_ratios=[height, 1, 1, 1])
        # cell edges: step t's cell (and stair) spans t - 0.5 to t + 0.5, and so does request i's
        x, y = np.arange(len(self.steps) + 1) - 0.5, np.arange(len(rows) + 1) - 0.5  # (T+1,) (R+1,)
        rgba = colors.to_rgba_array(["white"] + [color for _, color in LEGEND.values()])  # by code
        ax.pcolormesh(x, y, rgba[grid], ec="white", lw=0.5 if grid.size < 20000 else 0)
        # (H, 2): the step and the row of each prefix-cache hit
        hits = np.reshape([(t, i) for i, row in enumerate(rows) for t in row.hits], (-1, 2))
        ax.plot(*hits.T, "*", c="gold", mec="black", ms=9.5, mew=1.5, label="prefix-cache hit")
        # a bar at each finish step; an unfinished request's None is NaN, drawn nowhere
        ax.plot([r.finish for r in rows], range(len(rows)), "k|", ms=11, mew=1.5, label="finish")
        if len(rows) <= 40:  # few enough to label each row (the ylabel says what the number is)
            ax.set_yticks(range(len(rows)), [f"#{r.seq_id} ({r.num_prompt_tokens})" for r in rows])
        ax.set(ylabel="request (prompt tokens)", ylim=(len(rows) - 0.5, -0.5))  # the first on top
        s = Step(*np.array(self.steps, int).reshape(-1, len(Step._fields)).T)  # each field (T,)
        kv.stairs(s.num_used_blocks, x, fill=True, color="#807dba",
                  label=f"in use, of {c.num_kvcache_blocks}")
        # the prefill steps' tokens over every step's tokens as decode (drawn under them: zorder 0)
        tok.stairs(s.num_tokens * s.is_prefill, x, fill=True, color=rgba[PREFILL], label="prefill")
        tok.stairs(s.num_tokens, x, fill=True, color=rgba[DECODE], label="decode", zorder=0)
        tok.stairs(s.num_sampled * (1 - s.is_prefill), x, color="black", label="decode: kept")
        bs.stairs(s.num_seqs, x, label="batch size", lw=1.5)
        bs.stairs(s.num_waiting, x, color="grey", label="waiting", lw=1.5)
        states = [patches.Patch(color=color, label=label) for label, color in LEGEND.values()]
        ax.legend(handles=[*states, *ax.lines], loc="upper left", bbox_to_anchor=(1.005, 1))
        for panel, label in ((kv, "KV blocks"), (tok, "tokens / step"), (bs, "requests")):
            panel.legend(loc="upper left", bbox_to_anchor=(1.005, 1))  # right of the panel
            panel.set_ylabel(label)
        bs.set_xlabel("engine step (the batch postprocessed)")
        # overlap_scheduling as run: with tensor parallelism the engine runs the plain loop
        fig.suptitle(f"{Path(c.model).name} on {c.device}, tp={c.tensor_parallel_size}: "
                     f"{len(rows)} requests in {len(self.steps)} steps\n{c.num_kvcache_blocks} KV "
                     f"blocks of {c.kvcache_block_size} tokens, max_num_batched_tokens="
                     f"{c.max_num_batched_tokens}, max_num_seqs={c.max_num_seqs}, "
                     f"enable_prefix_caching={c.enable_prefix_caching}, overlap_scheduling="
                     f"{c.overlap_scheduling and c.tensor_parallel_size == 1}")
        fig.savefig(path, dpi=100)
        return fig

