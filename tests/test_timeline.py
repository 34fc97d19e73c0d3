"""The timeline recorder against what the scheduler did, and the trace seen from a plain program.

A scripted run of the scheduler alone (test_scheduler's FakeRunner, no model), plain and with
overlap scheduling, where a long prompt is chunked, later prompts hit the prefix cache and a small
KV cache forces a preemption. An Oracle wraps the scheduler's own methods to log, at the moment
they act, what each step does; every column the Timeline records must equal it. Then the figure
renders on the CPU; and a subprocess with NANOSERVE_TRACE=1 and no logging set up shows the trace.
"""
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_scheduler import (  # noqa: F401
    BS,
    EOS,
    FakeRunner,
    make_seq,
    model_dir,
    overlap_loop,
    plain_step,
    prompt,
)

from nanoserve.config import Config
from nanoserve.extensions.overlap import OverlapLoop
from nanoserve.extensions.timeline import (
    CHUNK,
    DECODE,
    IDLE,
    LEGEND,
    PREEMPTED,
    PREFILL,
    RECOMPUTE,
    WAITING,
    Step,
    Timeline,
)
from nanoserve.scheduler import Batch, Scheduler
from nanoserve.sequence import Sequence

SHARED = prompt(12, 500)  # 3 full blocks of a system prompt that several requests share
LATE_EOS_AT = 14  # request 3 samples EOS as its 15th token: with overlap, seen a step late


@dataclass
class Scheduled:
    """What the scheduler did for one batch, logged as it did it."""
    batch: Batch  # held, so that no later batch reuses its id()
    cells: dict[int, int]  # seq_id -> the kind of its cell
    hits: dict[int, int] = field(default_factory=dict)  # seq_id -> prompt tokens from the cache
    preempted: list[int] = field(default_factory=list)  # seq_ids preempted while scheduling it


class Oracle:
    """Logs what the scheduler does, from inside its own methods (and overlap's decode ahead):
    for each batch, each sequence's cell kind from where its chunk starts and ends, the prefix
    hits of the sequences it allocated, and the sequences preempted while scheduling it."""

    def __init__(self, sched: Scheduler, loop: OverlapLoop | None) -> None:
        self.log: dict[int, Scheduled] = {}  # by id(batch)
        self.ever_preempted: set[int] = set()
        self.allocated: list[Sequence] = []  # by the schedule_prefill call running now
        self.preempting: list[int] = []  # by the schedule_decode call running now
        bm_allocate, prefill, decode, preempt = (sched.block_manager.allocate,
                                                 sched.schedule_prefill, sched.schedule_decode,
                                                 sched._preempt)

        def allocate(seq: Sequence) -> bool:
            ok = bm_allocate(seq)
            self.allocated += [seq] if ok else []
            return ok

        def schedule_prefill(in_flight: Batch | None = None) -> Batch:
            self.allocated = []
            batch = prefill(in_flight)
            # batch.starts is where each chunk starts (overlap counts a chunk in flight)
            cells = {seq.seq_id: RECOMPUTE if seq.seq_id in self.ever_preempted else
                     PREFILL if start + n == seq.num_tokens else CHUNK
                     for seq, start, n in zip(batch.seqs, batch.starts, batch.num_new_tokens)}
            hits = {seq.seq_id: seq.num_cached_tokens for seq in self.allocated
                    if seq.num_cached_tokens}
            self.log[id(batch)] = Scheduled(batch, cells, hits)
            return batch

        def schedule_decode() -> Batch:
            self.preempting = []
            batch = decode()
            self.log[id(batch)] = Scheduled(batch, {seq.seq_id: DECODE for seq in batch.seqs},
                                            preempted=self.preempting)
            return batch

        def _preempt(seq: Sequence) -> None:
            self.preempting.append(seq.seq_id)
            self.ever_preempted.add(seq.seq_id)
            preempt(seq)

        def schedule_decode_ahead(batch: Batch) -> Batch | None:  # overlap's, never preempts
            if (nxt := decode_ahead(batch)) is not None:
                self.log[id(nxt)] = Scheduled(nxt, {seq.seq_id: DECODE for seq in nxt.seqs})
            return nxt

        sched.block_manager.allocate = allocate
        sched.schedule_prefill, sched.schedule_decode, sched._preempt = (
            schedule_prefill, schedule_decode, _preempt)
        if loop is not None:
            decode_ahead, loop._schedule_decode = loop._schedule_decode, schedule_decode_ahead


def sample(seq: Sequence) -> int:
    """Never EOS, except request 3 at output position LATE_EOS_AT (PENDING counts as a token)."""
    late = seq.token_ids[len(SHARED)] == 300 and seq.num_output_tokens == LATE_EOS_AT
    return EOS if late else 7


def workload() -> dict[int, list[Sequence]]:
    """step -> the requests added before it: a 30-token prompt (chunked by a budget of 16), then
    three sharing SHARED (the second and third hit its blocks), and one late arrival that hits
    them too; 16 blocks of 4 tokens run out while they decode, so the newest is preempted."""
    return {0: [make_seq(prompt(30), max_tokens=8),
                make_seq(SHARED + prompt(3, 100), max_tokens=16),
                make_seq(SHARED + prompt(4, 200), max_tokens=16),
                make_seq(SHARED + prompt(5, 300), max_tokens=24)],
            6: [make_seq(SHARED + prompt(5, 400), max_tokens=12)]}


def used_blocks(seqs: list[Sequence]) -> int:
    return len({block for seq in seqs for block in seq.block_table})


@pytest.mark.parametrize("overlap", [False, True])
def test_timeline_records_what_the_scheduler_did(model_dir, overlap, tmp_path):  # noqa: F811
    config = Config(model_dir, num_kvcache_blocks=16, kvcache_block_size=BS, max_model_len=64,
                    max_num_batched_tokens=16, device="cpu", overlap_scheduling=overlap)
    sched = Scheduler(config, eos_token_ids={EOS})
    runner = FakeRunner(sample)
    loop = overlap_loop(sched, runner) if overlap else None
    # what an engine holds: Timeline reads config, scheduler and num_sampled
    timeline = Timeline(SimpleNamespace(config=config, scheduler=sched, num_sampled=0))
    oracle = Oracle(sched, loop)
    arrivals, added, finish, late = workload(), [], {}, []
    while arrivals or sched.has_unfinished():
        step = len(timeline.steps)
        for seq in arrivals.pop(step, []):
            sched.add(seq)
            added.append(seq)
        finished, batch = loop.step() if loop else plain_step(sched, runner)
        timeline.after_step(batch, finished)
        # this column, from the oracle: sequences that finished at an earlier step get no cell
        scheduled = oracle.log[id(batch)]
        cells = {sid: kind for sid, kind in scheduled.cells.items() if sid not in finish}
        cells |= {sid: PREEMPTED for sid in scheduled.preempted}
        late += [sid for sid in scheduled.cells if sid in finish]
        finish |= {seq.seq_id: step for seq in finished}
        rows = timeline.rows.values()
        assert {row.seq_id: row.cells[step] for row in rows if step in row.cells} == cells
        assert {row.seq_id: row.hits[step] for row in rows if step in row.hits} == scheduled.hits
        assert {row.seq_id for row in rows if row.finish == step} == {s.seq_id for s in finished}
        # num_sampled 0: this loop hands the tokens to the scheduler, not to an engine
        assert timeline.steps[step] == Step(batch.is_prefill, len(batch.seqs),
                                            sum(batch.num_new_tokens), 0, used_blocks(added),
                                            len(sched.waiting))
    # every request has a row, from the step it was added in, and every mechanism happened
    assert {r.seq_id: r.arrival for r in timeline.rows.values()} == \
        {seq.seq_id: 0 if i < 4 else 6 for i, seq in enumerate(added)}
    kinds = [kind for row in timeline.rows.values() for kind in row.cells.values()]
    assert {CHUNK, PREFILL, DECODE, PREEMPTED, RECOMPUTE} <= set(kinds)
    assert sum(map(len, (row.hits for row in timeline.rows.values()))) >= 3
    assert all(row.finish is not None for row in timeline.rows.values())
    assert bool(late) == overlap  # a decode ran past a late EOS, and drew no cell
    check_grid(timeline)
    fig = timeline.plot(tmp_path / "timeline.png")
    assert (tmp_path / "timeline.png").read_bytes()[:4] == b"\x89PNG"
    labels = {t.get_text() for ax in fig.axes if ax.get_legend() for t in ax.get_legend().texts}
    assert {label for label, _ in LEGEND.values()} | {"prefix-cache hit", "finish"} <= labels


def test_an_aborted_request_ends_where_it_was_aborted(model_dir):  # noqa: F811
    config = Config(model_dir, num_kvcache_blocks=16, kvcache_block_size=BS, max_model_len=64,
                    device="cpu")
    sched = Scheduler(config, eos_token_ids={EOS})
    timeline = Timeline(SimpleNamespace(config=config, scheduler=sched, num_sampled=0))
    runner = FakeRunner(lambda seq: 7)
    kept, aborted = make_seq(prompt(6), max_tokens=8), make_seq(prompt(6, 50), max_tokens=8)
    sched.add(kept, aborted)
    for _ in range(3):
        timeline.after_step(*reversed(plain_step(sched, runner)))
    sched.abort([aborted])  # as LLMEngine.abort_request does, between steps
    timeline.on_abort(aborted)
    while sched.has_unfinished():
        timeline.after_step(*reversed(plain_step(sched, runner)))
    rows = {row.seq_id: row for row in timeline.rows.values()}
    assert rows[aborted.seq_id].finish == 2 and max(rows[aborted.seq_id].cells) == 2
    assert rows[kept.seq_id].finish == len(timeline.steps) - 1 > 2
    check_grid(timeline)


def check_grid(timeline: Timeline) -> None:
    """The drawn grid: a row waits from its arrival to its first chunk and from a preemption to
    its recompute, has its recorded cells, is idle at every other step until its finish, and
    has nothing before its arrival or after its finish."""
    rows, grid = timeline.grid()
    for row, line in zip(rows, grid):
        prefills = sorted(t for t, kind in row.cells.items() if kind in (CHUNK, PREFILL, RECOMPUTE))
        waits = set(range(row.arrival, prefills[0]))
        for t in (t for t, kind in row.cells.items() if kind == PREEMPTED):
            waits |= set(range(t + 1, min(u for u in prefills if u > t)))
        life = range(row.arrival, row.finish + 1)
        expected = [row.cells.get(t, WAITING if t in waits else IDLE if t in life else 0)
                    for t in range(len(line))]
        assert list(line) == expected


@pytest.mark.slow  # the trace: test_e2e.py::test_text_prompts_and_trace
def test_trace_shows_in_a_plain_program_and_never_on_the_bar_line(tmp_path):
    """NANOSERVE_TRACE=1, no logging configured, a progress bar: the trace reaches stderr, and
    no line a terminal shows holds both the bar and a trace line. The same run draws its
    timeline through the public API (LLM(timeline=True))."""
    program = ("from nanoserve import LLM, SamplingParams\n"
               "with LLM(device='cpu', timeline=True, max_num_batched_tokens=8,\n"
               "         num_kvcache_blocks=64, max_model_len=1024) as llm:\n"
               "    llm.generate(['Hello, my name is', 'The sky is blue and the grass is'],\n"
               "                 SamplingParams(temperature=0, max_tokens=3))\n"
               f"    llm.timeline.plot({str(tmp_path / 'run.png')!r})\n"
               "    print(*{kind for row in llm.timeline.rows.values()\n"
               "            for kind in row.cells.values()})\n")
    env = os.environ | {"NANOSERVE_TRACE": "1"}
    run = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                         env=env, cwd=Path(__file__).parent.parent, timeout=300)
    assert run.returncode == 0, run.stderr
    shown = [line.rsplit("\r", 1)[-1] for line in run.stderr.split("\n")]  # what a terminal shows
    trace = [line for line in shown if line.startswith("nanoserve: ")]
    assert any(line.startswith("nanoserve: prefill") for line in trace)
    assert any(line.startswith("nanoserve: decode") for line in trace)
    assert "Generating" in run.stderr
    assert not [line for line in shown if "Generating" in line and "nanoserve: " in line]
    assert (tmp_path / "run.png").stat().st_size > 0
    kinds = set(map(int, run.stdout.split()))
    assert {CHUNK, PREFILL, DECODE} <= kinds
