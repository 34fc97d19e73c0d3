"""The README's timeline picture: a small CPU run made so that each scheduler mechanism shows.

    python tools/timeline_demo.py                  # writes results/timeline.png (about a minute)
    python tools/timeline_demo.py --out docs/timeline.png   # the README's picture, only when named
    python tools/timeline_demo.py --out t.png --no-overlap

The packaged default model (SmolLM2-135M-Instruct) on the CPU, greedy and ignoring EOS, so every
request makes exactly its max_tokens and the picture is the same on every machine:
- request 0's prompt (407 tokens) is longer than a step's budget (max_num_batched_tokens=128), so
  it is prefilled in chunks;
- requests 1-3 share a system prompt: 2 and 3 hit the blocks that 1 computes (prefix caching);
- request 4, with the same system prompt, arrives at step 14, while the others decode, and joins
  the running batch (continuous batching), hitting the cache too;
- 40 KV blocks of 16 tokens run out while the five decode, so the newest running request is
  preempted, then recomputed once request 0 finishes and frees its blocks.
"""
import argparse
from pathlib import Path

from nanoserve import LLM, SamplingParams

RESULTS = Path(__file__).resolve().parent.parent / "results"  # git-ignored, as bench.py's

SYSTEM = ("You are the demo assistant of nanoserve, a small inference engine written for students. "
          "Answer in two or three plain sentences, without lists, headings or code, and say so "
          "when you do not know. Prefer concrete examples to definitions.")
LONG_PROMPT = "Add up these numbers: " + " ".join(str(i) for i in range(1, 121))
QUESTIONS = ["What is a KV cache?", "Why batch requests together?", "What does a scheduler do?",
             "What is prefix caching?"]
# (the engine step a request arrives before, max_tokens): request 0 is LONG_PROMPT, then QUESTIONS
ARRIVALS = [(0, 24), (0, 40), (0, 48), (0, 56), (14, 32)]


def requests(llm: LLM) -> list[tuple[int, list[int], SamplingParams]]:
    """(arrival step, prompt token ids, params) of each request, in arrival order."""
    def chat(*messages: dict) -> list[int]:
        return llm.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True,
                                                 tokenize=True, return_dict=False)
    prompts = [chat({"role": "user", "content": LONG_PROMPT})]
    prompts += [chat({"role": "system", "content": SYSTEM}, {"role": "user", "content": q})
                for q in QUESTIONS]
    return [(step, ids, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
            for (step, n), ids in zip(ARRIVALS, prompts)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(RESULTS / "timeline.png"),
                        help="where the picture goes (results/ is git-ignored; docs/ only by name)")
    parser.add_argument("--no-overlap", action="store_true", help="the plain engine loop")
    args = parser.parse_args()
    with LLM(device="cpu", timeline=True, max_num_batched_tokens=128, kvcache_block_size=16,
             num_kvcache_blocks=40, max_model_len=640,
             overlap_scheduling=not args.no_overlap) as llm:
        pending = requests(llm)
        while pending or llm.scheduler.has_unfinished():
            # add_request + step: the engine loop of generate(), with requests arriving in it
            while pending and (pending[0][0] <= len(llm.timeline.steps)
                               or not llm.scheduler.has_unfinished()):
                llm.add_request(*pending.pop(0)[1:])
            llm.step()
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        llm.timeline.plot(args.out)
        print(f"{len(llm.timeline.steps)} steps, {llm.scheduler.num_preemptions} preemption(s); "
              f"wrote {args.out}")


if __name__ == "__main__":
    main()
