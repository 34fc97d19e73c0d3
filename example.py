"""Chat with a model through nanoserve: a few prompts, the model's chat template, one batched
generate.

    python example.py                      # packaged default SmolLM2-135M-Instruct, CPU or GPU
    python example.py --model DIR --temperature 0.7 --max-tokens 256 --trace
    python example.py --timeline timeline.png  # a picture of the run: requests x engine steps
    python example.py --kv-cache-dtype fp8     # K and V stored as float8 e4m3: half the bytes
"""
import argparse

from nanoserve import LLM, SamplingParams

PROMPTS = [
    "Introduce yourself in one sentence.",
    "What is the capital of France, and what is it famous for?",
    "Write a haiku about a paged KV cache.",
    "Give three tips for writing readable Python.",
]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None,
                        help="Hugging Face layout directory (default: packaged SmolLM2)")
    parser.add_argument("--temperature", type=float, default=0.6, help="0 = greedy")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--trace", action="store_true", help="log one line per engine step")
    parser.add_argument("--timeline", metavar="PATH",
                        help="draw the run (requests x engine steps) to this image, e.g. a .png")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                        help="the KV cache: the model's dtype, or float8 e4m3 (half the bytes)")
    args = parser.parse_args()
    try:  # a bad value (a negative temperature, a missing model) ends here, in one line
        params = SamplingParams(temperature=args.temperature, top_p=0.95,
                                max_tokens=args.max_tokens)
        llm = LLM(args.model, trace=args.trace, timeline=args.timeline is not None,
                  kv_cache_dtype=args.kv_cache_dtype)
    except ValueError as e:
        parser.error(str(e))

    with llm:
        chats = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}],
                                                   tokenize=False, add_generation_prompt=True)
                 for p in PROMPTS]
        outputs = llm.generate(chats, params)
        if args.timeline:
            llm.timeline.plot(args.timeline)
    for prompt, out in zip(PROMPTS, outputs):
        n = len(out["token_ids"])
        print(f"\n>>> {prompt}\n{out['text'].strip()}\n[{n} tokens, {out['finish_reason']}]")


if __name__ == "__main__":
    main()
