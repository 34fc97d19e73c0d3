"""Guided decoding: output that follows a JSON schema, a regular expression, a choice or a grammar.

`SamplingParams(guided_decoding=GuidedDecodingParams(json=schema))` (or regex=, choice=, grammar=,
json_object=True) asks for it.

xgrammar does the work. A constraint is parsed when its GuidedDecodingParams is made (a bad one
raises there) and compiled against the vocabulary on a pool of threads from the moment its
request arrives; the compiler caches by the constraint's text, so
requests that share a schema compile it once. Each request keeps a matcher: the state of its output
in the grammar. Every step, before the sampler, the matchers of the guided rows fill a bitmask of
the tokens allowed next (on the engine's thread, or past POOL_ROWS rows on several, while the GPU
runs the step's forward pass), and
the disallowed logits of those rows become -inf; unguided rows are not touched. The step's recorded
tokens then advance the matchers. EOS is allowed only where the grammar may end, and once it is done
only EOS is, so a finished grammar finishes its request ("stop"); max_tokens may still cut it
("length"). JSON is generated without free whitespace, so a small model cannot loop on blanks inside
an object.
Tokens a row's sequence has that are not recorded yet come first. With overlap scheduling the
token of the step in flight: the matcher takes it once it is on the host, before the next step's
mask, and that step's postprocessing finds it taken. With speculative decoding the drafts before
the row: its mask comes from a fork of the matcher that took them, and the forks are dropped after
the step, so nothing needs rolling back.
An Extension, the first in the engine's list (so top-k/p choose among allowed tokens): on_request
starts the compile, before_sample masks, after_sample notes the step, on_tokens advances the
matchers. Logprobs are the model's, before the mask.
"""
import functools
import json
import re
import weakref
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, fields

import numpy as np
import torch
import xgrammar as xgr
from torch import Tensor

from nanoserve.extensions.overlap import PENDING
from nanoserve.llm_engine import LLMEngine
from nanoserve.model_runner import Extension, StepOutput
from nanoserve.scheduler import Batch
from nanoserve.sequence import Sequence

ANY_OBJECT = '{"type": "object", "additionalProperties": true}'  # json_object=True's schema
# xgrammar starts and joins its pool of threads at every fill: up to this many rows, one thread
# fills them sooner (docs/guided_decoding.md has the figures)
POOL_ROWS = 128
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


def accept(guides: list[Guide], tokens: list[int]) -> None:
    """Each guide's matcher takes its token."""
    xgr.BatchGrammarMatcher.batch_accept_token([g.matcher for g in guides], tokens)
    for guide in guides:
        guide.num_tokens += 1


def row_matchers(seqs: list[Sequence], rows: list[int], guides: dict[Sequence, Guide]
                 ) -> list[xgr.GrammarMatcher | None]:
    """The matcher whose state each guided row samples in (None: leave the row unmasked):
    its sequence's, or with speculative decoding a fork that took the drafts before the row
    (None where the grammar refuses one: verification then stops before the row)."""
    num_rows, matchers, j = Counter(seqs[i] for i in rows), [], 0
    for i in rows:
        seq = seqs[i]
        if i > 0 and seqs[i - 1] is seq:  # draft j's row: row j-1's matcher after draft j-1
            j, fork = j + 1, matchers[-1] and matchers[-1].fork()
            # (the drafts are the sequence's last num_rows - 1 tokens)
            taken = fork and fork.accept_token(seq.token_ids[j - num_rows[seq]])
            matchers.append(fork if taken and not fork.is_terminated() else None)
        else:
            j, matcher = 0, guides[seq].matcher
            matchers.append(None if matcher.is_terminated() else matcher)
    return matchers


class Guided(Extension):
    def __init__(self, engine: LLMEngine) -> None:
        cfg, runner = engine.config, engine.model_runner
        self.scheduler, self.to_device = engine.scheduler, runner.to_device
        # the tokenizer's ids: the logits' ids past them (padding) have no text, and are refused
        self.vocab_size = min(len(engine.tokenizer), cfg.hf_config.vocab_size)
        info = xgr.TokenizerInfo.from_huggingface(engine.tokenizer, vocab_size=self.vocab_size,
                                                  stop_token_ids=sorted(self.scheduler.eos_token_ids))
        self.compiler = xgr.GrammarCompiler(info)  # caches compiled grammars by their text
        # four grammars compile at once, each on several threads of xgrammar's own
        self.compiling = ThreadPoolExecutor(4, "nanoserve-grammar")
        # fill the rows' masks: on this thread, or above POOL_ROWS rows on a pool of several
        self.fillers = (xgr.BatchGrammarMatcher(max_threads=1), xgr.BatchGrammarMatcher())
        # (rows, V / 32) int32 on the host, pinned on CUDA, whence a stream of its own copies it
        k = cfg.num_speculative_tokens if cfg.speculative_method else 0  # a row per draft too
        cuda = runner.device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(runner.device) if cuda else None
        bitmask = xgr.allocate_token_bitmask(cfg.max_num_seqs * (1 + k), self.vocab_size)
        self.bitmask = bitmask.pin_memory() if cuda else bitmask
        # per guided sequence, as long as it lives: its compiled grammar, then its Guide
        self.grammars: weakref.WeakKeyDictionary[Sequence, Future] = weakref.WeakKeyDictionary()
        self.guides: weakref.WeakKeyDictionary[Sequence, Guide] = weakref.WeakKeyDictionary()
        self.last: tuple[list[Sequence], StepOutput] | None = None  # the last step sampled
        self.caught_up: StepOutput | None = None  # the last step whose tokens _catch_up took

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
        guides = {seqs[i]: self.guide(seqs[i]) for i in rows}
        self._catch_up(guides)
        live = [(i, m) for i, m in zip(rows, row_matchers(seqs, rows, guides)) if m]
        indices, bitmask = [i for i, _ in live], self.bitmask[:len(seqs)]  # (S, V / 32)
        filler = self.fillers[len(live) > POOL_ROWS]
        filler.batch_fill_next_token_bitmask([m for _, m in live], bitmask, indices)
        if any(seqs[i].params.logprobs is not None for i in rows):
            logits = logits.clone()  # the model's own logits stay for the logprobs
        if self.copy_stream is not None:  # on the copy engine, while the forward pass runs
            with torch.cuda.stream(self.copy_stream):
                bitmask = bitmask.to(logits.device, non_blocking=True)
            torch.cuda.current_stream().wait_stream(self.copy_stream)
            bitmask.record_stream(torch.cuda.current_stream())
        index = (slice(None) if len(live) == len(seqs)  # the rows, on the device without waiting
                 else self.to_device(np.array(indices, np.int64)))
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size,
                                        indices=None if isinstance(index, slice) else index)
        logits[index, self.vocab_size:] = float("-inf")
        return logits

    def _catch_up(self, guides: dict[Sequence, Guide]) -> None:
        """With overlap scheduling a sequence may end in the token of the step in flight: its
        matcher takes it now, read from that step's output (waiting for it)."""
        behind = [seq for seq, guide in guides.items()
                  if seq.token_ids[-1] == PENDING and guide.num_tokens < seq.num_output_tokens]
        if behind:
            last_seqs, out = self.last
            tokens, self.caught_up = dict(zip(last_seqs, out.tolist())), out
            accept([guides[seq] for seq in behind], [tokens[seq] for seq in behind])

    def after_sample(self, logits: Tensor, token_ids: Tensor, seqs: list[Sequence],
                     out: StepOutput) -> None:
        self.last = seqs, out

    def on_tokens(self, batch: Batch, out: StepOutput, token_ids: list[int]) -> list[Sequence]:
        """Advance the matchers of the guided sequences that got a token now, their last (but
        for tokens taken already, by _catch_up: all of a step's that matter, as the step after
        it holds every sequence that goes on)."""
        if self.guides and out is not self.caught_up:
            guides, tokens = [], []
            for seq in batch.seqs:
                if (guide := self.guides.get(seq)) and guide.num_tokens < seq.num_output_tokens:
                    guides.append(guide)
                    tokens.append(seq.token_ids[-1])
            if guides:
                accept(guides, tokens)
        return []

