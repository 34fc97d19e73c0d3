"""Samples: several answers to one prompt. `SamplingParams(n=4)` returns four samples of the prompt;
`best_of=k` runs k and returns the n whose sampled tokens are likeliest (the highest cumulative
logprob); `LLM.beam_search` keeps the beam_width likeliest continuations.

An Extension without step hooks, switched on by LLM.generate for a request with n > 1 or best_of and
by LLM.beam_search, built on the engine's own generate: each sample, and each beam's next token, is
a request of its own with the same prompt. The paged cache shares what they have in common: the
first sample registers the prompt's full blocks as it is scheduled, and the others, in the same step
or later, hit them (block_manager), so those blocks are computed and held once; each sample computes
the prompt's last, partly filled block again (fewer than block_size tokens) into a block of its own,
its copy on write. A beam is a prompt whose full blocks are cached: it holds them with every beam
that shares them and computes only its last block. Without the prefix cache each sample holds its
own prompt.

Sample i of a seeded request draws with the seed (seed, i) (sample 0 with the seed itself): the same
tokens in any batch, and sample 0 is the request's answer with n=1.
"""
from dataclasses import dataclass, replace

from nanoserve.config import SamplingParams, check_fields
from nanoserve.model_runner import Extension


def sample_params(params: SamplingParams) -> list[SamplingParams]:
    """The SamplingParams of each sample a request runs (best_of, or n, of them): one sample each,
    seeded by (seed, i); with best_of, each also reports its tokens' logprobs, which rank them."""
    if params.best_of is not None and params.best_of < params.n:  # (an int >= 1: SamplingParams)
        raise ValueError(f"best_of must be None or an integer >= n={params.n}, got "
                         f"{params.best_of}")
    logprobs = params.logprobs if params.best_of is None else params.logprobs or 0
    return [replace(params, n=1, best_of=None, logprobs=logprobs,
                    seed=params.seed if params.seed is None or i == 0 else
                    hash((params.seed, i)) % 2**63)
            for i in range(params.best_of or params.n)]


def cumulative_logprob(token_ids: list[int], logprobs: list[dict[int, float]]) -> float:
    """The sum of a sample's sampled tokens' logprobs: what best_of ranks by."""
    return sum(lp[t] for lp, t in zip(logprobs, token_ids))


def best(samples: list[dict], params: SamplingParams) -> list[dict]:
    """The n samples to return: the first n, or with best_of the n with the highest
    "cumulative_logprob" (added to each), likeliest first."""
    if params.best_of is None:
        return samples[:params.n]
    for s in samples:
        s["cumulative_logprob"] = cumulative_logprob(s["token_ids"], s["logprobs"])
        if params.logprobs is None:  # asked for ranking only
            del s["logprobs"]
    return sorted(samples, key=lambda s: -s["cumulative_logprob"])[:params.n]


BEAM_CHECKS = (
    ("beam_width", lambda v: isinstance(v, int) and v >= 1, "an integer >= 1"),
    ("max_tokens", lambda v: isinstance(v, int) and v >= 1, "an integer >= 1"),
    ("length_penalty", lambda v: isinstance(v, (int, float)), "a real number"),
    ("early_stopping", lambda v: isinstance(v, bool), "True or False"),
)


@dataclass(frozen=True)
class BeamSearchParams:
    """LLM.beam_search's settings, named as vLLM's; a beam's score is its cumulative logprob over
    (its output length ** length_penalty), as transformers' generate(num_beams=beam_width,
    do_sample=False, length_penalty, early_stopping) scores it."""
    beam_width: int = 4
    max_tokens: int = 64
    length_penalty: float = 1.0
    ignore_eos: bool = False
    early_stopping: bool = False  # stop once beam_width beams ended (else: once none can win)

    def __post_init__(self) -> None:
        check_fields(self, BEAM_CHECKS)


@dataclass
class Search:
    """One prompt's beam search, transformers' way: the beam_width likeliest running beams, and
    the beam_width best finished ones (ended by EOS or max_tokens) with their scores."""
    prompt: list[int]
    params: BeamSearchParams
    running: list[tuple[float, list[int]]]  # (cumulative logprob, tokens), likeliest first
    finished: list[tuple[float, float, list[int]]]  # (score, cumulative logprob, tokens)
    done: bool = False

    def advance(self, tops: list[dict[int, float]], eos: set[int]) -> None:
        """One step: tops[i], running beam i's top 2 * beam_width {token: logprob}."""
        width, penalty, length = (self.params.beam_width, self.params.length_penalty,
                                  len(self.running[0][1]) - len(self.prompt) + 1)
        candidates = sorted(((score + lp, tokens + [t]) for (score, tokens), top
                             in zip(self.running, tops) for t, lp in top.items()),
                            key=lambda c: -c[0])[:2 * width]

        def ends(tokens: list[int]) -> bool:
            return length == self.params.max_tokens or (
                tokens[-1] in eos and not self.params.ignore_eos)
        full = len(self.finished) == width
        if not (full and self.params.early_stopping):  # the top beam_width that end, finished
            self.finished += [(score / length ** penalty, score, tokens)
                              for score, tokens in candidates[:width] if ends(tokens)]
            self.finished = sorted(self.finished, key=lambda f: -f[0])[:width]
        self.running = [c for c in candidates if not ends(c[1])][:width]
        full = len(self.finished) == width
        hopeless = full and (not self.running or self.running[0][0] / length ** penalty
                             <= self.finished[-1][0])
        self.done = hopeless or (full and self.params.early_stopping) or not self.running


class Samples(Extension):
    """What LLM.generate (a request with n > 1 or best_of) and LLM.beam_search hand over: the
    engine's own generate, called with one request per sample or per beam. No step hook."""

    def generate(self, prompts: list, params: list[SamplingParams],
                 use_tqdm: bool) -> list[dict | list[dict]]:
        """Every sample of every prompt in one call; per prompt its output dict (n=1) or the list
        of its n, in sample order (best_of: likeliest first)."""
        runs = [sample_params(sp) for sp in params]
        outs = iter(self.engine.generate([p for p, run in zip(prompts, runs) for _ in run],
                                         [s for run in runs for s in run], use_tqdm))
        chosen = [best([next(outs) for _ in run], sp) for sp, run in zip(params, runs)]
        return [c[0] if sp.n == 1 else c for c, sp in zip(chosen, params)]

    def beam_search(self, prompts: list, params: BeamSearchParams) -> list[list[dict]]:
        """Per prompt, its beam_width best beams, best first: {"text", "token_ids",
        "cumulative_logprob", "score"}. Each step asks the engine, for every running beam of every
        prompt, for the next token's top 2 * beam_width logprobs (one generate call)."""
        engine = self.engine
        if not engine.config.enable_prefix_caching:
            raise ValueError("beam search shares the beams' blocks through the prefix cache: "
                             "create the LLM with enable_prefix_caching=True")
        ids = [engine.make_sequence(p, SamplingParams(max_tokens=params.max_tokens)).token_ids
               for p in prompts]  # validated, tokenized
        searches = [Search(p, params, [(0.0, p)], []) for p in ids]
        step = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True,
                              logprobs=2 * params.beam_width)
        while live := [s for s in searches if not s.done]:
            beams = [tokens for s in live for _, tokens in s.running]
            tops = iter(out["logprobs"][0] for out in engine.generate(beams, step, use_tqdm=False))
            for s in live:
                s.advance([next(tops) for _ in s.running], engine.scheduler.eos_token_ids)
        decode = engine.tokenizer.decode
        return [[{"text": decode(tokens[len(s.prompt):], skip_special_tokens=True),
                  "token_ids": tokens[len(s.prompt):], "cumulative_logprob": logprob,
                  "score": score} for score, logprob, tokens in s.finished] for s in searches]
