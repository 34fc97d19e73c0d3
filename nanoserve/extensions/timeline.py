"""Timeline: what every engine step did to every request, recorded and drawn as one picture.

Owns: the record (a column per step, a row per request: prefill chunks, decodes, preemption and
recompute, prefix-cache hits, the finish; per step: tokens, batch size, KV blocks in use) and its
matplotlib figure. Does not own scheduling: it reads what the scheduler did from host-side state it
already keeps (the batch, the queues, Scheduler.stats()), so recording adds no device sync, and an
engine without `timeline=True` builds none. Attaches at the core's "a step's outputs" point (a
StepObserver); users read it as `llm.timeline`:

    llm = LLM(timeline=True)                 # or: python example.py --timeline timeline.png
    llm.generate(prompts, params)
    llm.timeline.plot("timeline.png")

Invariant: column i is the i-th batch postprocessed. With overlap scheduling the step after it is
already scheduled by then, so the blocks that step allocated count as in use in column i.
"""
from dataclasses import dataclass, field
from itertools import islice, takewhile
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from nanoserve.config import Config
from nanoserve.llm_engine import LLMEngine, StepObserver
from nanoserve.scheduler import Batch, Scheduler
from nanoserve.sequence import Sequence

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

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
    num_tokens: int  # its length when last seen: a prefill that adds a token completed the prompt
    cells: dict[int, int] = field(default_factory=dict)
    hits: dict[int, int] = field(default_factory=dict)  # step -> prompt tokens from prefix cache
    finish: int | None = None  # the step that finished it


class Step(NamedTuple):
    is_prefill: bool
    num_seqs: int  # the batch size
    num_tokens: int  # tokens computed
    num_used_blocks: int  # KV blocks in use after the step
    num_waiting: int  # requests in the waiting queue after the step


class Timeline(StepObserver):
    def __init__(self, config: Config, scheduler: Scheduler) -> None:
        self.config, self.scheduler = config, scheduler
        self.rows: dict[int, Row] = {}  # by seq_id
        self.steps: list[Step] = []
        self.num_preemptions = scheduler.stats().num_preemptions  # as last seen

    def after_step(self, batch: Batch, finished: list[Sequence]) -> list[Sequence]:
        self.record(batch, finished)
        return []

    def record(self, batch: Batch, finished: list[Sequence]) -> None:
        """Add a column: `batch` was just postprocessed and `finished` ended in it. Costs
        O(batch + arrivals + preemptions): it never walks the whole queues."""
        step, sched, stats = len(self.steps), self.scheduler, self.scheduler.stats()
        for seq in batch.seqs:
            row = self._row(seq, step)
            if row.finish is None:  # with overlap, a decode can run one step past a late EOS
                row.cells[step] = self._prefill_cell(row, seq, step) if batch.is_prefill else DECODE
        # arrivals: add() appends to `waiting`, and a prefill scheduled ahead (overlap) appends to
        # `running`, so requests not seen yet are at the backs of the queues
        for queue in (sched.waiting, sched.running):
            for seq in takewhile(lambda s: s.seq_id not in self.rows, reversed(queue)):
                self._row(seq, step)
        # since the last column, only this batch's scheduling preempted (schedule_decode), each
        # sequence to the front of `waiting`
        for seq in islice(sched.waiting, stats.num_preemptions - self.num_preemptions):
            row = self._row(seq, step)
            row.cells[step], row.num_tokens = PREEMPTED, seq.num_tokens
        self.num_preemptions = stats.num_preemptions
        for seq in finished:
            self._row(seq, step).finish = step
        self.steps.append(Step(batch.is_prefill, len(batch.seqs), sum(batch.num_new_tokens),
                               stats.num_blocks - stats.num_free_blocks, stats.num_waiting))

    def on_abort(self, seq: Sequence) -> None:
        """A request aborted between steps (LLMEngine.abort_request) ends at the last column."""
        if (row := self.rows.get(seq.seq_id)) is not None and row.finish is None:
            row.finish = max(row.arrival, len(self.steps) - 1)

    def _row(self, seq: Sequence, step: int) -> Row:
        # seen at its first prefill at the latest: until then, its tokens are its prompt
        n = seq.num_prompt_tokens
        return self.rows.setdefault(seq.seq_id, Row(seq.seq_id, n, step, num_tokens=n))

    def _prefill_cell(self, row: Row, seq: Sequence, step: int) -> int:
        # its first chunk since it arrived or was preempted starts past the cached prefix
        if next(reversed(row.cells.values()), PREEMPTED) == PREEMPTED and seq.num_cached_tokens:
            row.hits[step] = seq.num_cached_tokens
        # a chunk samples nothing; the last chunk appends the first token
        done, row.num_tokens = seq.num_tokens > row.num_tokens, seq.num_tokens
        return RECOMPUTE if PREEMPTED in row.cells.values() else PREFILL if done else CHUNK

    def grid(self) -> tuple[list[Row], np.ndarray]:
        """The rows in arrival order and their cells as codes (R, T), the gaps filled in: WAITING
        from arrival to the first prefill chunk and from a preemption to the recompute, IDLE
        elsewhere until the finish."""
        rows = sorted(self.rows.values(), key=lambda row: row.seq_id)
        grid = np.zeros((len(rows), len(self.steps)), np.int8)  # (R, T)
        for i, row in enumerate(rows):
            waiting, end = True, len(self.steps) if row.finish is None else row.finish + 1
            for t in range(row.arrival, end):
                cell = row.cells.get(t, 0)
                grid[i, t] = cell or (WAITING if waiting else IDLE)
                waiting = cell == PREEMPTED if cell else waiting
        return rows, grid

    def title(self) -> str:
        c = self.config
        overlap = c.overlap_scheduling and c.tensor_parallel_size == 1  # TP runs the plain loop
        return (f"{Path(c.model).name} on {c.device}, tp={c.tensor_parallel_size}: "
                f"{len(self.rows)} requests in {len(self.steps)} steps\n"
                f"{self.scheduler.stats().num_blocks} KV blocks of {c.kvcache_block_size} tokens, "
                f"max_num_batched_tokens={c.max_num_batched_tokens}, max_num_seqs={c.max_num_seqs}"
                f", enable_prefix_caching={c.enable_prefix_caching}, overlap_scheduling={overlap}")

    def plot(self, path: str | Path) -> "Figure":
        """Draw the run and save it to path (the format by its suffix); return the figure."""
        # imported here: the engine itself never needs matplotlib. A bare Figure, not pyplot:
        # savefig draws it with Agg, so no display and no global state
        from matplotlib.figure import Figure
        height = min(9.0, max(2.5, 0.3 * len(self.rows)))  # of the requests' panel, in inches
        fig = Figure(figsize=(13, height + 5), layout="constrained")
        ax, kv, tok, bs = fig.subplots(4, 1, sharex=True, height_ratios=[height, 1, 1, 1])
        self._draw_requests(ax)
        # per step, as stairs over the requests' cells: KV blocks, tokens, batch size
        edges = np.arange(len(self.steps) + 1) - 0.5  # (T + 1,)
        is_prefill, num_seqs, num_tokens, num_used, num_waiting = (
            np.array(self.steps, int).reshape(-1, len(Step._fields)).T)  # each (T,)
        kv.stairs(num_used, edges, fill=True, color="#807dba", label="in use")
        kv.axhline(self.scheduler.stats().num_blocks, color="black", ls="--", label="total")
        for label, kind, tokens in (("prefill", PREFILL, num_tokens * is_prefill),
                                    ("decode", DECODE, num_tokens * (1 - is_prefill))):
            tok.stairs(tokens, edges, fill=True, color=LEGEND[kind][1], label=label)
        bs.stairs(num_seqs, edges, label="batch size", lw=1.5)
        bs.stairs(num_waiting, edges, color="grey", label="waiting", lw=1.5)
        for panel, label in ((kv, "KV blocks"), (tok, "tokens / step"), (bs, "requests")):
            panel.set_ylabel(label)
            panel.legend(loc="upper left", bbox_to_anchor=(1.005, 1))
        bs.set_xlabel("engine step (the batch postprocessed)")
        fig.suptitle(self.title())
        fig.savefig(path, dpi=100)
        return fig

    def _draw_requests(self, ax: "Axes") -> None:
        """A cell per request and step, a star on each prefix-cache hit, a bar at each finish."""
        from matplotlib.colors import to_rgba_array
        from matplotlib.patches import Patch
        rows, grid = self.grid()
        colors = to_rgba_array(["white"] + [LEGEND[code][1] for code in sorted(LEGEND)])
        ax.pcolormesh(np.arange(grid.shape[1] + 1) - 0.5, np.arange(len(rows) + 1) - 0.5,
                      colors[grid], edgecolors="white", linewidth=0.5 if grid.size < 20000 else 0)
        hits = [(t, i, n) for i, row in enumerate(rows) for t, n in row.hits.items()]
        ends = [(row.finish, i) for i, row in enumerate(rows) if row.finish is not None]
        handles = [Patch(color=color, label=label) for label, color in LEGEND.values()]
        handles.append(ax.scatter([h[0] for h in hits], [h[1] for h in hits], 90, "gold",
                                  marker="*", edgecolors="black", label="prefix-cache hit"))
        handles.append(ax.scatter([e[0] for e in ends], [e[1] for e in ends], 120, "black",
                                  marker="|", label="finish"))
        if len(rows) <= 40:  # few enough to label each row and each hit
            ax.set_yticks(range(len(rows)), [f"#{r.seq_id} ({r.num_prompt_tokens} tok)"
                                             for r in rows])
            for t, i, n in hits:
                ax.annotate(f"{n} cached", (t, i), xytext=(6, -3), textcoords="offset points")
        ax.invert_yaxis()
        ax.set_ylabel("request (prompt tokens)")
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.005, 1))


def attach(engine: LLMEngine) -> Timeline:
    engine.timeline = Timeline(engine.config, engine.scheduler)
    engine.observers.append(engine.timeline)
    return engine.timeline
