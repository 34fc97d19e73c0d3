"""Speculative decoding: n-gram proposals, verified in one step, the same tokens as without it.

Proposal (prompt lookup): a sequence whose last n tokens (n from prompt_lookup_max down to
prompt_lookup_min) appeared earlier in it proposes the tokens that followed there, at most
num_speculative_tokens: its drafts. They join its token list for one decode step, which computes
the newest token and the drafts together: a row of the batch per token, each attending to the
cache up to itself (the core's decode of several tokens per sequence).
Verification: row j samples the token after it with the key a step without drafts would use
there, so draft j + 1 is accepted exactly when row j's race picks it. The first row whose pick
differs gives the sequence its last token of the step; the drafts after it are dropped and their
blocks go back. Greedy and seeded requests get the tokens they get without speculation; unseeded
ones keep the model's distribution (each token is the plain sampler's draw given those before).
Each accepted token is recorded as a step of its own would record it (EOS, stop tokens,
max_tokens, logprobs, the prefix cache's hashes), so only accepted tokens enter the cache's index.
A StepLoop (the core's step-loop point), on top of the loop it would replace, its fallback (the
plain loop, or overlap's): a step's drafts need the tokens of the step before, so a step with
drafts is never overlapped, but a large batch that proposes nothing hands its steps to it.
"""
import dataclasses
import logging
import weakref

import numpy as np

from nanoserve.config import cdiv
from nanoserve.llm_engine import LLMEngine, StepLoop
from nanoserve.model_runner import StepOutput
from nanoserve.scheduler import Batch
from nanoserve.sequence import Sequence

logger = logging.getLogger("nanoserve")
MAX_CANDIDATES = 8  # earlier occurrences of its last n_min tokens a lookup compares, latest first
# With overlap scheduling, a decode of more than SMALL_BATCH sequences that proposed nothing hands
# its next steps to the overlap loop, PROBE_EVERY at first and twice as many after each further
# try that finds nothing (up to MAX_PROBE_EVERY): a large batch that gains nothing keeps its pace
SMALL_BATCH, PROBE_EVERY, MAX_PROBE_EVERY = 16, 16, 1024


class NgramIndex:
    """Where each n_min-gram of a sequence's tokens ended, kept up to date as its tokens grow: a
    proposal costs O(new tokens + MAX_CANDIDATES n_max), not O(sequence)."""

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min, self.n_max = n_min, n_max
        # n_min-gram -> the index of its last token, at its latest occurrence; earlier[i]: the
        # occurrence before the one ending at index i (-1: none). Ints, not a list per n-gram:
        # long-lived containers would make Python's garbage collector scan them again and again
        self.latest: dict[tuple[int, ...], int] = {}
        self.earlier: list[int] = [-1] * (n_min - 1)  # one entry per index indexed so far

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the earlier occurrence of tokens' longest suffix (n_min to
        n_max tokens; of equal ones the latest) among the last MAX_CANDIDATES occurrences of its
        last n_min tokens; [] when they never occurred before."""
        n_min, best, best_len = self.n_min, None, 0
        for end in range(len(self.earlier), len(tokens) - 1):  # the last token ends no earlier one
            key = tuple(tokens[end + 1 - n_min:end + 1])
            self.earlier.append(self.latest.get(key, -1))
            self.latest[key] = end
        end = self.latest.get(tuple(tokens[-n_min:]), -1)
        for _ in range(MAX_CANDIDATES):
            if end < 0:
                break
            n = n_min  # how far back the match goes, up to n_max
            while n < self.n_max and end - n >= 0 and tokens[end - n] == tokens[-1 - n]:
                n += 1
            if n > best_len:
                best, best_len = end, n
            end = self.earlier[end]
        return [] if best is None else tokens[best + 1:best + 1 + k]


@dataclasses.dataclass
class SpecStats:
    """Counts since start-up, named like vLLM's spec_decode counters."""
    num_drafts: int = 0  # sequence-steps that proposed drafts
    num_draft_tokens: int = 0  # tokens proposed
    num_accepted_tokens: int = 0  # of those, accepted

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a sequence-step with drafts emits, on average: 1 + accepted drafts."""
        return 1 + self.num_accepted_tokens / max(self.num_drafts, 1)

    def add(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self.num_drafts += num_draft_tokens > 0
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens


class SpeculativeLoop(StepLoop):
    def __init__(self, engine: LLMEngine, fallback: StepLoop) -> None:
        """fallback: the loop that runs the steps without drafts (see PROBE_EVERY)."""
        super().__init__(engine.scheduler, engine.model_runner, engine.postprocess)
        cfg = engine.config
        if cfg.prompt_lookup_min > cfg.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min={cfg.prompt_lookup_min} exceeds prompt_lookup_max"
                             f"={cfg.prompt_lookup_max}: the lookup's n-gram sizes are a range")
        self.config, self.fallback = cfg, fallback
        self.k, self.stats, self.last_step = cfg.num_speculative_tokens, SpecStats(), SpecStats()
        # per sequence, as long as it lives: its lookup index and its own counts
        self.indexes: weakref.WeakKeyDictionary[Sequence, NgramIndex] = weakref.WeakKeyDictionary()
        self.requests: weakref.WeakKeyDictionary[Sequence, SpecStats] = weakref.WeakKeyDictionary()
        self.max_rows = self.model_runner.max_graph_batch or cfg.max_num_seqs * (1 + self.k)
        self.probe = 0  # steps left to the fallback before the next try at drafting
        self.probe_every = PROBE_EVERY  # the next wait, doubled by each try that finds nothing
        logger.info(f"speculative decoding: {cfg.speculative_method}, up to {self.k} tokens per "
                    f"step, n-grams of {cfg.prompt_lookup_min}..{cfg.prompt_lookup_max} tokens; "
                    f"steps without drafts: {type(fallback).__name__}")

    def step(self) -> tuple[list[Sequence], Batch]:
        """A prefill as the plain loop runs it, or a decode step with every sequence's drafts;
        or the fallback's step (see PROBE_EVERY)."""
        if self.probe > 0 and len(self.scheduler.running) > SMALL_BATCH:
            self.probe -= 1
            return self.fallback.step()
        if (in_flight := self.fallback.finish()) is not None:  # its step launched ahead
            return in_flight
        batch, drafts = self.scheduler.schedule_prefill(), {}
        if not batch.seqs:
            drafts = self.propose()
            batch = self.scheduler.schedule_decode()
            in_batch = set(batch.seqs)  # drafts of sequences left out (preempted) go
            self.drop_drafts([seq for seq in drafts if seq not in in_batch], drafts)
        try:
            out = self.model_runner.run(self.rows(batch, drafts) if drafts else batch)
            token_ids = out.tolist()
        except BaseException:
            self.drop_drafts(list(drafts), drafts)
            self.scheduler.cancel(batch)  # its prompts wait again
            raise
        if not drafts:
            if not batch.is_prefill:
                self.probe, self.probe_every = self.probe_every, min(2 * self.probe_every,
                                                                     MAX_PROBE_EVERY)
            return self.postprocess(batch, out, token_ids), batch
        self.probe_every = PROBE_EVERY
        # what the step computed: each sequence's newest token and its drafts
        num_new = [1 + len(drafts.get(seq, ())) for seq in batch.seqs]
        starts = [start + 1 - n for start, n in zip(batch.starts, num_new)]
        return self.verify(batch, out, token_ids, drafts), Batch(batch.seqs, num_new, False, starts)

    def propose(self) -> dict[Sequence, list[int]]:
        """Drafts for the running sequences, appended to their tokens; none when their blocks do
        not fit or their rows would leave the captured CUDA graphs."""
        running = list(self.scheduler.running)[:self.scheduler.max_num_seqs]
        room, drafts = self.max_rows - len(running), {}
        for seq in running:
            params = seq.params
            limit = min(self.k, room, params.max_tokens - seq.num_output_tokens - 1)
            index = self.indexes.setdefault(seq, NgramIndex(self.config.prompt_lookup_min,
                                                            self.config.prompt_lookup_max))
            if limit > 0 and (draft := index.propose(seq.token_ids, limit)):
                drafts[seq], room = draft, room - len(draft)
        bm = self.scheduler.block_manager
        if sum(bm.num_missing_blocks(seq, len(d)) for seq, d in drafts.items()) > \
                bm.num_free_blocks:
            return {}  # drafts never preempt a sequence
        for seq, draft in drafts.items():
            seq.token_ids += draft
        return drafts

    @staticmethod
    def rows(batch: Batch, drafts: dict[Sequence, list[int]]) -> Batch:
        """The decode step with a row per token: each sequence's newest token, then its drafts,
        each row attending to the cache up to its own token and sampling the token after it."""
        seqs, starts = [], []
        for seq, start in zip(batch.seqs, batch.starts):
            num_rows = 1 + len(drafts.get(seq, ()))
            seqs += [seq] * num_rows
            starts += range(start - num_rows + 1, start + 1)
        return Batch(seqs, [1] * len(seqs), False, starts)

    @staticmethod
    def drop_drafts(seqs: list[Sequence], drafts: dict[Sequence, list[int]]) -> None:
        """Take seqs' drafts out of their tokens (and out of drafts)."""
        for seq in seqs:
            if seq in drafts:
                del seq.token_ids[-len(drafts.pop(seq)):]

    def verify(self, batch: Batch, out: StepOutput, token_ids: list[int],
               drafts: dict[Sequence, list[int]]) -> list[Sequence]:
        """Keep each sequence's drafts up to the first its rows did not sample, then record the
        emitted tokens in rounds: round j records the (j+1)-th token of every sequence that
        emits one, as a plain decode step would. Returns the sequences that finished."""
        emitted, row, self.last_step = [], 0, SpecStats()  # emitted: the rows each sequence keeps
        for seq in batch.seqs:
            draft = drafts.get(seq, [])
            num_accepted = next((j for j, t in enumerate(draft) if token_ids[row + j] != t),
                                len(draft))
            emitted.append(range(row, row + num_accepted + 1))
            row += 1 + len(draft)
            for stats in (self.stats, self.last_step, self.requests.setdefault(seq, SpecStats())):
                stats.add(len(draft), num_accepted)
        self.drop_drafts(list(drafts), drafts)  # each token is appended again as it is recorded
        finished = []
        for j in range(max(map(len, emitted))):  # (a stop string ends a sequence's run there)
            now = [(seq, rows[j]) for seq, rows in zip(batch.seqs, emitted)
                   if j < len(rows) and not seq.is_finished]
            seqs, rows = [seq for seq, _ in now], [r for _, r in now]
            if seqs:
                finished += self.postprocess(Batch.decode(seqs), select(out, rows),
                                             [token_ids[r] for r in rows])
        bm = self.scheduler.block_manager
        for seq in batch.seqs:  # the blocks only rejected drafts were to fill go back
            if not seq.is_finished:
                bm.free(seq, keep=cdiv(seq.num_tokens, bm.block_size))
        return finished

    @property
    def progress(self) -> str:
        """Acceptance for the progress bar and the trace: the last step's, and since start-up the
        mean tokens a sequence-step with drafts emits."""
        last = self.last_step
        return (f", drafts {last.num_accepted_tokens}/{last.num_draft_tokens} accepted, "
                f"{self.stats.mean_accepted_length:.2f} tokens/draft step")

    def counts(self, seq: Sequence | None = None) -> dict[str, int]:
        """SpecStats' counts since start-up, or seq's ({} if it ran no decode step here)."""
        stats = self.stats if seq is None else self.requests.get(seq)
        return {} if stats is None else dataclasses.asdict(stats)

    def finish(self) -> tuple[list[Sequence], Batch] | None:
        """The fallback's step in flight, if any (its own steps leave none)."""
        return self.fallback.finish()

    def cancel(self) -> None:
        self.fallback.cancel()


def select(out: StepOutput, rows: list[int]) -> StepOutput:
    """The rows of a step's output (host copies, already waited for)."""
    index = np.array(rows)
    return StepOutput(out.host[index], out.host[index], None,
                      {name: tuple(t[index] for t in ts) for name, ts in out.extras.items()})

