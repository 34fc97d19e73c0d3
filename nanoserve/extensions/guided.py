"""Guided decoding: output that follows a JSON schema, a regular expression, a choice or a grammar.

`SamplingParams(guided_decoding=GuidedDecodingParams(json=schema))` (or regex=, choice=, grammar=,
json_object=True) asks for it.

xgrammar does the work. A constraint is parsed when its GuidedDecodingParams is made (a bad one
raises there) and compiled against the vocabulary on a pool of threads from the moment its
request arrives; the compiler caches by the constraint's text, so requests that share a schema
compile it once. Each request keeps a matcher: the state of its output in the grammar.
Every step, before the sampler, while the GPU runs the step's forward pass:
1. each guided row's matcher takes the tokens its sequence holds that it has not taken yet: the
   last step's, and with overlap scheduling the token of the step in flight, read from its output
   once it is on the host;
2. the matchers fill a bitmask of the tokens allowed next into buffers made once (on the
   engine's thread, or on a pool of threads made once, ROWS_PER_FILLER rows or more each);
3. the disallowed logits of those rows become -inf; unguided rows are not touched. On CUDA a
   batch of up to GRAPH_ROWS rows, all guided, replays the masks' copy and xgrammar's kernel as
   one CUDA graph, captured the first time its logits' place is seen (a lone request's hook would
   spend most of its host time launching them).
With speculative decoding a draft's row takes its mask from a fork of the matcher that took the
drafts before it; the forks are dropped after the step, so nothing needs rolling back.
EOS is allowed only where the grammar may end, and once it is done only EOS is, so a finished
grammar finishes its request ("stop"); max_tokens may still cut it ("length"). JSON is generated
without free whitespace, so a small model cannot loop on blanks inside an object.
An Extension, the first in the engine's list (so top-k/p choose among allowed tokens): on_request
starts the compile, before_sample advances the matchers and masks, after_sample notes the step.
Logprobs are the model's, before the mask.
"""
import functools
import json
import operator
import os
import re
import weakref
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, fields

import torch
import xgrammar as xgr

from nanoserve.extensions.overlap import PENDING
from nanoserve.model_runner import Extension, StepOutput
from nanoserve.sequence import Sequence

# xgrammar's own pool starts and joins its threads at every fill (docs/guided_decoding.md has the
# figures): rows fill on up to WORKERS threads that live as long as the engine (vLLM: at most 8),
# each filling a run of at least ROWS_PER_FILLER rows on one thread; fewer on the engine's thread.
# A batch of up to GRAPH_ROWS rows, all masked, masks with a CUDA graph; MAX_GRAPHS are kept
ROWS_PER_FILLER, GRAPH_ROWS, MAX_GRAPHS = 16, 8, 64
WORKERS = min(8, max(2, (os.cpu_count() or 2) // 2))
# an EBNF string literal, escaped as a JSON string but with characters past ASCII as they are:
# escaped, one past the BMP becomes a surrogate pair, which xgrammar reads as two characters
LITERAL = functools.partial(json.dumps, ensure_ascii=False)


@dataclass(frozen=True)
class GuidedDecodingParams:
    """What a request's output must be: exactly one field set (vLLM's names)."""
    json: str | dict | None = None  # a JSON schema (its text or a dict): JSON that it accepts
    regex: str | None = None  # text that this regular expression matches in full
    choice: tuple[str, ...] | None = None  # one of these strings
    grammar: str | None = None  # text of this EBNF grammar (xgrammar's dialect, rule `root`)
    json_object: bool = False  # True: any JSON object

    def __post_init__(self) -> None:
        given = [f.name for f in fields(self) if getattr(self, f.name) not in (None, False)]
        if len(given) != 1:
            raise ValueError("GuidedDecodingParams takes exactly one of json, regex, choice, "
                             f"grammar, json_object; got {given or 'none'}")
        if self.choice is not None:
            if isinstance(self.choice, str) or not self.choice or not all(
                    isinstance(c, str) and c for c in self.choice):
                raise ValueError(f"choice must list 1+ non-empty strings, got {self.choice!r}")
            object.__setattr__(self, "choice", tuple(self.choice))
        parse(*self.source)  # a bad schema, regex or grammar raises here

    @property
    def source(self) -> tuple[str, str]:
        """(kind, text): what xgrammar compiles, kind "json", "regex" or "grammar"."""
        if self.choice is not None:
            return "grammar", "root ::= " + " | ".join(map(LITERAL, self.choice))
        if self.json is not None:
            return "json", self.json if isinstance(self.json, str) else json.dumps(self.json)
        if self.json_object:  # any object
            return "json", '{"type": "object", "additionalProperties": true}'
        return ("regex", self.regex) if self.regex is not None else ("grammar", self.grammar)


@functools.lru_cache(maxsize=1024)
def parse(kind: str, text: str) -> xgr.Grammar:
    """The constraint as an xgrammar Grammar; a ValueError that names what is wrong with it."""
    try:
        if kind == "json":  # no free whitespace: separators are exactly ", " and ": "
            return xgr.Grammar.from_json_schema(text, any_whitespace=False)
        return xgr.Grammar.from_regex(text) if kind == "regex" else xgr.Grammar.from_ebnf(text)
    except (RuntimeError, ValueError, TypeError) as e:  # xgrammar's C++ errors: drop the place
        reason = re.sub(r"^\[[\d:]+\] \S+:\d+: (Check failed: .* is false: )?", "", str(e).strip())
        raise ValueError(f"bad guided_decoding {kind}: {reason}") from None


@dataclass
class Guide:
    """A guided request's place in its grammar."""
    matcher: xgr.GrammarMatcher
    num_tokens: int = 0  # output tokens the matcher took
    done: bool = False  # the matcher took a stop token that ended its grammar: no mask is left


class Guided(Extension):
    def __init__(self, engine) -> None:  # an LLMEngine
        cfg, runner = engine.config, engine.model_runner
        self.device, self.eos = runner.device, frozenset(engine.scheduler.eos_token_ids)
        # the tokenizer's ids: the logits' ids past them (padding) have no text, and are refused
        self.vocab_size = min(len(engine.tokenizer), cfg.hf_config.vocab_size)
        info = xgr.TokenizerInfo.from_huggingface(engine.tokenizer, vocab_size=self.vocab_size,
                                                  stop_token_ids=sorted(self.eos))
        self.compiler = xgr.GrammarCompiler(info)  # caches compiled grammars by their text
        # four grammars compile at once, each on several threads of xgrammar's own
        self.compiling = ThreadPoolExecutor(4, "nanoserve-grammar")
        # a filler for each thread of the filling pool, rows_per_filler rows or more each
        self.filling = ThreadPoolExecutor(WORKERS, "nanoserve-fill")
        self.rows_per_filler, self.graph_rows = ROWS_PER_FILLER, GRAPH_ROWS
        self.fillers = [xgr.BatchGrammarMatcher(max_threads=1) for _ in range(WORKERS)]
        # made once: the masks (rows, V / 32) and the masked rows (rows,) on the host, pinned on
        # CUDA; a row per sequence, and per draft with speculative decoding
        drafts = cfg.num_speculative_tokens if cfg.speculative_method else 0
        rows, cuda = cfg.max_num_seqs * (1 + drafts), self.device.type == "cuda"
        buffers = xgr.allocate_token_bitmask(rows, self.vocab_size), torch.zeros(rows).int()
        self.bitmask, self.rows = (b.pin_memory() for b in buffers) if cuda else buffers
        self.filled = self.bitmask.numpy()  # the masks as xgrammar fills them (cheaper to pass)
        # on CUDA: the masks' copy on the device; the masking's CUDA graphs by their logits'
        # place (address, dtype, shape, strides), captured on a stream of their own
        self.on_device = torch.empty_like(self.bitmask, device=self.device) if cuda else None
        self.graphs, self.capturing = {}, torch.cuda.Stream() if cuda else None
        # per guided sequence, as long as it lives: its compiled grammar, then its Guide
        self.grammars: weakref.WeakKeyDictionary[Sequence, Future] = weakref.WeakKeyDictionary()
        self.guides: weakref.WeakKeyDictionary[Sequence, Guide] = weakref.WeakKeyDictionary()
        self.last: tuple[list[Sequence], StepOutput] | None = None  # the last step sampled

    def on_request(self, seq: Sequence, streamed: bool) -> None:
        """Start compiling a guided request's grammar, on the pool's threads."""
        if seq.params.guided_decoding is not None and seq not in self.grammars:
            self.grammars[seq] = self.compiling.submit(
                self.compiler.compile_grammar, parse(*seq.params.guided_decoding.source))

    def before_sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """logits (S, V) with -inf where a guided row's grammar refuses the token."""
        rows = [i for i, seq in enumerate(seqs) if seq.params.guided_decoding is not None]
        if not rows:
            return logits
        # the last step's tokens (with overlap scheduling a sequence may end in the step in
        # flight's): waiting for them also waits for the buffers' last copies, queued before them
        in_flight = dict(zip(self.last[0], self.last[1].tolist())) if self.last else {}
        masked, matchers = self._live_rows(seqs, rows, in_flight)  # the rows to mask, and how
        # filler j fills every n-th row from the j-th, on the pool's threads past one filler, in
        # C++ alone (Python in n threads would queue for the GIL)
        n = max(1, min(len(self.fillers), len(masked) // self.rows_per_filler))
        fills = [functools.partial(f.batch_fill_next_token_bitmask, matchers[j::n], self.filled,
                                   masked[j::n]) for j, f in enumerate(self.fillers[:n])]
        list(map(operator.call, fills) if n == 1 else self.filling.map(operator.call, fills))
        if any(seqs[i].params.logprobs is not None for i in rows):
            logits = logits.clone()  # the model's own logits stay for the logprobs
        self.rows.numpy()[:len(masked)] = masked  # their index (None: every row is masked)
        self._mask(logits, self.rows[:len(masked)] if len(masked) < len(seqs) else None)
        return logits

    def _mask(self, logits: torch.Tensor, index: torch.Tensor | None) -> None:
        """Launch the masking. On CUDA up to graph_rows rows, all masked, replay it as a graph
        captured at the logits' place the first time it is seen (launched then): one launch in
        place of the copy's, xgrammar's kernel's and the padding write's."""
        if self.capturing is None or index is not None or len(logits) > self.graph_rows:
            return self._launch(logits, index)
        key = (logits.data_ptr(), logits.dtype, *logits.shape, *logits.stride())
        if (graph := self.graphs.get(key)) is not None:
            return graph.replay()
        self._launch(logits, None)
        if len(self.graphs) < MAX_GRAPHS:
            graph = self.graphs[key] = torch.cuda.CUDAGraph()
            with torch.cuda.stream(self.capturing):  # captured, not run
                graph.capture_begin(capture_error_mode="thread_local")
                self._launch(logits, None)
                graph.capture_end()

    def _launch(self, logits: torch.Tensor, index: torch.Tensor | None) -> None:
        bitmask = self.bitmask[:len(logits)]
        if self.device.type == "cuda":  # queued after the forward pass, from pinned memory
            bitmask = self.on_device[:len(logits)].copy_(bitmask, non_blocking=True)
            index = None if index is None else index.to(self.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size, indices=index)
        if self.vocab_size < logits.shape[-1]:
            logits[slice(None) if index is None else index, self.vocab_size:] = float("-inf")

    def _live_rows(self, seqs: list[Sequence], rows: list[int], in_flight: dict[Sequence, int]
                   ) -> tuple[list[int], list[xgr.GrammarMatcher]]:
        """The guided rows to mask, and the matcher of each: its sequence's, once it took the
        tokens the sequence holds and it had not, but the drafts; with speculative decoding a
        draft's row, a fork that took the drafts before the row (none where the grammar refuses
        one: verification then stops before the row). A matcher whose grammar ended masks none."""
        num_rows = Counter([seqs[i] for i in rows])  # a sequence's row, then one per draft
        masked, matchers, j, matcher = [], [], 0, None
        for i in rows:
            seq = seqs[i]
            if i > 0 and seqs[i - 1] is seq:  # draft j's row: row j-1's matcher after draft j-1
                j, fork = j + 1, matcher and matcher.fork()  # (drafts: the last num_rows - 1)
                taken = fork and fork.accept_token(seq.token_ids[j - num_rows[seq]])
                matcher = fork if taken and not fork.is_terminated() else None
            else:
                j, matcher = 0, self._catch_up(seq, num_rows[seq], in_flight)
            if matcher is not None:
                masked.append(i)
                matchers.append(matcher)
        return masked, matchers

    def _catch_up(self, seq: Sequence, rows: int, in_flight: dict) -> xgr.GrammarMatcher | None:
        """seq's matcher (None once its grammar ended) after it takes the tokens seq holds and
        it has not taken, but the drafts: one call a token (xgrammar's batch call holds Python's
        lock as long and adds a list). Its Guide is made on first use, once the grammar compiled."""
        if (guide := self.guides.get(seq)) is None:
            self.on_request(seq, streamed=False)  # (a request that came before the extension)
            guide = self.guides[seq] = Guide(xgr.GrammarMatcher(self.grammars[seq].result()))
        # the drafts, the last rows - 1 tokens, are not taken
        tokens = seq.token_ids[seq.num_prompt_tokens + guide.num_tokens:seq.num_tokens - rows + 1]
        for token in tokens:
            token = in_flight.get(seq, token) if token == PENDING else token
            guide.matcher.accept_token(token)
            if token in self.eos:  # only a stop token ends a grammar: then ask the matcher
                guide.done = guide.matcher.is_terminated()
        guide.num_tokens += len(tokens)
        return None if guide.done else guide.matcher

    def after_sample(self, logits, token_ids, seqs, out: StepOutput) -> None:
        self.last = seqs, out
