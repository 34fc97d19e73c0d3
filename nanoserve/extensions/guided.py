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
3. the disallowed logits of those rows become -inf; unguided rows are not touched.
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
from torch import Tensor

from nanoserve.extensions.overlap import PENDING
from nanoserve.llm_engine import LLMEngine
from nanoserve.model_runner import Extension, StepOutput
from nanoserve.sequence import Sequence

ANY_OBJECT = '{"type": "object", "additionalProperties": true}'  # json_object=True's schema
# xgrammar's own pool starts and joins its threads at every fill (docs/guided_decoding.md has the
# figures): rows fill on up to WORKERS threads that live as long as the engine (vLLM: at most 8),
# each filling a run of at least ROWS_PER_FILLER rows on one thread; fewer on the engine's thread
ROWS_PER_FILLER = 16
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
        if self.json_object:
            return "json", ANY_OBJECT
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


def row_matchers(seqs: list[Sequence], rows: list[int], guides: dict[Sequence, Guide],
                 num_rows: Counter[Sequence]) -> list[xgr.GrammarMatcher | None]:
    """The matcher whose state each guided row samples in (None: leave the row unmasked):
    its sequence's, or with speculative decoding a fork that took the drafts before the row
    (None where the grammar refuses one: verification then stops before the row). num_rows:
    each sequence's rows."""
    matchers, j = [], 0
    for i in rows:
        seq = seqs[i]
        if i > 0 and seqs[i - 1] is seq:  # draft j's row: row j-1's matcher after draft j-1
            j, fork = j + 1, matchers[-1] and matchers[-1].fork()
            # (the drafts are the sequence's last num_rows - 1 tokens)
            taken = fork and fork.accept_token(seq.token_ids[j - num_rows[seq]])
            matchers.append(fork if taken and not fork.is_terminated() else None)
        else:
            j, guide = 0, guides[seq]
            matchers.append(None if guide.done else guide.matcher)
    return matchers


class Guided(Extension):
    def __init__(self, engine: LLMEngine) -> None:
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
        self.rows_per_filler = ROWS_PER_FILLER
        self.fillers = [xgr.BatchGrammarMatcher(max_threads=1) for _ in range(WORKERS)]
        # made once: the masks (rows, V / 32) and the masked rows (rows,) on the host, pinned on
        # CUDA; `copied` marks the end of their last copies to the GPU
        k = cfg.num_speculative_tokens if cfg.speculative_method else 0  # a row per draft too
        cuda = self.device.type == "cuda"
        buffers = (xgr.allocate_token_bitmask(cfg.max_num_seqs * (1 + k), self.vocab_size),
                   torch.zeros(cfg.max_num_seqs * (1 + k), dtype=torch.int32))
        self.bitmask, self.rows = (b.pin_memory() for b in buffers) if cuda else buffers
        self.copied: torch.cuda.Event | None = None
        # per guided sequence, as long as it lives: its compiled grammar, then its Guide
        self.grammars: weakref.WeakKeyDictionary[Sequence, Future] = weakref.WeakKeyDictionary()
        self.guides: weakref.WeakKeyDictionary[Sequence, Guide] = weakref.WeakKeyDictionary()
        self.last: tuple[list[Sequence], StepOutput] | None = None  # the last step sampled

    def on_request(self, seq: Sequence, streamed: bool) -> None:
        """Start compiling a guided request's grammar, on the pool's threads."""
        if seq.params.guided_decoding is not None and seq not in self.grammars:
            self.grammars[seq] = self.compiling.submit(
                self.compiler.compile_grammar, parse(*seq.params.guided_decoding.source))

    def guide(self, seq: Sequence) -> Guide:
        """seq's Guide, made on first use (waiting for its grammar to compile)."""
        if (guide := self.guides.get(seq)) is None:
            self.on_request(seq, streamed=False)  # (a request that came before the extension)
            guide = self.guides[seq] = Guide(xgr.GrammarMatcher(self.grammars[seq].result()))
        return guide

    def before_sample(self, logits: Tensor, seqs: list[Sequence]) -> Tensor:
        """logits (S, V) with -inf where a guided row's grammar refuses the token."""
        rows = [i for i, seq in enumerate(seqs) if seq.params.guided_decoding is not None]
        if not rows:
            return logits
        num_rows = Counter(seqs[i] for i in rows)  # a sequence's row, then one per draft
        guides = {seq: self.guide(seq) for seq in num_rows}
        # with overlap scheduling a sequence may end in the step in flight's token: wait for it
        pending = any(seq.token_ids[-1] == PENDING for seq in guides)
        in_flight = dict(zip(self.last[0], self.last[1].tolist())) if pending else {}
        if self.copied is not None:  # the buffers' last copies left them (in decode long since:
            # they came before the tokens waited for above)
            self.copied.synchronize()
        self._catch_up(num_rows, guides, in_flight)
        live = [(i, m) for i, m in zip(rows, row_matchers(seqs, rows, guides, num_rows)) if m]
        # filler j fills every n-th row from the j-th, on the pool's threads past one filler, in
        # C++ alone (Python in n threads would queue for the GIL)
        n = max(1, min(len(self.fillers), len(live) // self.rows_per_filler))
        fills = [functools.partial(filler.batch_fill_next_token_bitmask, [m for _, m in live[j::n]],
                                   self.bitmask, [i for i, _ in live[j::n]])
                 for j, filler in enumerate(self.fillers[:n])]
        list(map(operator.call, fills) if n == 1 else self.filling.map(operator.call, fills))
        if any(seqs[i].params.logprobs is not None for i in rows):
            logits = logits.clone()  # the model's own logits stay for the logprobs
        bitmask, index = self.bitmask[:len(seqs)], None  # None: every row is masked
        if len(live) < len(seqs):  # the masked rows' index
            index = self.rows[:len(live)]
            index.numpy()[:] = [i for i, _ in live]
        if self.device.type == "cuda":  # queued after the forward pass, from pinned memory
            bitmask = bitmask.to(self.device, non_blocking=True)
            index = None if index is None else index.to(self.device, non_blocking=True)
            self.copied = torch.cuda.current_stream().record_event()
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size, indices=index)
        if self.vocab_size < logits.shape[-1]:
            logits[slice(None) if index is None else index, self.vocab_size:] = float("-inf")
        return logits

    def _catch_up(self, num_rows: Counter[Sequence], guides: dict[Sequence, Guide],
                  in_flight: dict[Sequence, int]) -> None:
        """The matchers of the sequences (with their rows) take the tokens their sequences hold
        and they have not taken, but the drafts (a draft's row takes its mask from a fork). One
        call a token: xgrammar's batch call holds Python's lock as long and adds a list."""
        for seq, rows in num_rows.items():
            guide = guides[seq]
            end = len(seq.token_ids) - (rows - 1)  # the drafts are the rows after the first
            tokens = seq.token_ids[seq.num_prompt_tokens + guide.num_tokens:end]
            for token in tokens:
                token = in_flight.get(seq, token) if token == PENDING else token
                guide.matcher.accept_token(token)
                if token in self.eos:  # only a stop token ends a grammar: then ask the matcher
                    guide.done = guide.matcher.is_terminated()
            guide.num_tokens += len(tokens)

    def after_sample(self, logits: Tensor, token_ids: Tensor, seqs: list[Sequence],
                     out: StepOutput) -> None:
        self.last = seqs, out
