"""bench_utils.py: what bench.py needs around a benchmark but is not one.

It owns the description of the machine (hardware_info, gpu_limits), nvidia-smi sampling while an
engine runs (gpu_monitor, summarize_gpu) and the random-weight Qwen3 the GPU workloads run on
(build_random_qwen3, with a decode-only tokenizer). It times nothing and knows no workload.
Called by bench.py and the tools that reuse its model (tools/profile_steps.py, bench_micro.py).
"""
import contextlib
import gc
import os
import platform
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:   # imported lazily at run time: transformers takes seconds to import
    from transformers import PreTrainedTokenizerFast

BOS_ID, EOS_ID = 151643, 151645    # Qwen3's <|endoftext|> and <|im_end|>
INIT_STD = 0.02                    # random weights with this std keep logits in a sane range
NVIDIA_SMI_TIMEOUT_S = 30
GPU_SAMPLE_MS = 200
GPU_LIMIT_FIELDS = "clocks.max.sm,clocks.max.mem,power.limit,driver_version"
GPU_SAMPLE_FIELDS = "clocks.sm,clocks.mem,temperature.gpu,power.draw,clocks_event_reasons.active"


def log(msg: str) -> None:
    print(msg, flush=True)


def free_memory() -> None:
    """Release what the last engine held, so the next one starts with the whole GPU."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- the machine
def git_commit() -> str | None:
    """`git describe --always --dirty`: "-dirty" says the figures are not quite that commit's.
    NANOSERVE_COMMIT names it instead where the tree travels without its git metadata."""
    if os.environ.get("NANOSERVE_COMMIT"):
        return os.environ["NANOSERVE_COMMIT"]
    try:
        return subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True,
                              text=True, cwd=Path(__file__).parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def hardware_info(cpu: bool) -> dict:
    """Versions, processor, GPU name, count and limits, and the commit: a result's conditions."""
    import transformers
    info = {"torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "cpu": platform.processor() or platform.machine()}
    if not cpu:
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_count"] = torch.cuda.device_count()
        info["gpu_limits"] = gpu_limits()
    commit = git_commit()
    if commit:
        info["commit"] = commit
    return info


def nvidia_smi_args(fields: str, *extra: str) -> list[str]:
    return ["nvidia-smi", f"--query-gpu={fields}", *extra, "-i", "0"]


def gpu_limits() -> str | None:
    """The first GPU's clock ceilings, power limit and driver: machines of one kind differ in
    throughput by a few percent, and these settings may explain it."""
    try:
        out = subprocess.run(nvidia_smi_args(GPU_LIMIT_FIELDS, "--format=csv,noheader"),
                             capture_output=True, text=True, check=True,
                             timeout=NVIDIA_SMI_TIMEOUT_S).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    pairs = zip(GPU_LIMIT_FIELDS.split(","), out.split(","))
    return ", ".join(f"{name} {value.strip()}" for name, value in pairs)


@contextlib.contextmanager
def gpu_monitor(device: str) -> Iterator[list[str]]:
    """nvidia-smi samples (CSV lines) every GPU_SAMPLE_MS while the block runs: a run slower than
    another on the same code shows whether its GPU ran at other clocks, hotter or throttled."""
    samples: list[str] = []
    proc = None
    if device == "cuda":
        args = nvidia_smi_args(GPU_SAMPLE_FIELDS, "--format=csv,noheader,nounits",
                               "-lms", str(GPU_SAMPLE_MS))
        with contextlib.suppress(OSError):   # no nvidia-smi: the run goes on unsampled
            proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                    text=True)
    try:
        yield samples
    finally:
        if proc is not None:
            proc.terminate()
            samples += proc.communicate(timeout=NVIDIA_SMI_TIMEOUT_S)[0].splitlines()


def summarize_gpu(samples: list[str]) -> str | None:
    """Busy samples only (power at or above its median): SM and memory clocks, temperature, mean
    power and the clock event reasons seen."""
    rows = [line.split(", ") for line in samples if line.count(", ") == 4]
    try:
        values = [(float(sm), float(mem), float(temp), float(power), reason)
                  for sm, mem, temp, power, reason in rows]
    except ValueError:  # "[N/A]" fields on some machines
        return None
    if not values:
        return None
    median_power = sorted(v[3] for v in values)[len(values) // 2]
    busy = [v for v in values if v[3] >= median_power]
    sm, mem, temp, power = ([v[i] for v in busy] for i in range(4))
    reasons = sorted({v[4] for v in busy})
    return (f"{len(busy)} busy samples: SM {min(sm):.0f}-{max(sm):.0f} MHz, "
            f"memory {min(mem):.0f}-{max(mem):.0f} MHz, {min(temp):.0f}-{max(temp):.0f} C, "
            f"{sum(power) / len(power):.0f} W mean, event reasons {reasons}")


# ----------------------------------------------------------------------------- the model
def build_tokenizer(vocab_size: int) -> "PreTrainedTokenizerFast":
    """A decode-only tokenizer: token i is the word "<i>". Prompts are token ids, so nothing else
    is needed."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {f"<{i}>": i for i in range(vocab_size) if i not in (BOS_ID, EOS_ID)}
    vocab.update({"<|endoftext|>": BOS_ID, "<|im_end|>": EOS_ID})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>",
                                   eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   unk_token="<|endoftext|>")


def build_random_qwen3(out_dir: Path, shape: dict, device: str) -> str:
    """Qwen3 with random bf16 weights plus a tokenizer, saved once in out_dir and then reused."""
    if (out_dir / "config.json").exists() and (out_dir / "tokenizer.json").exists():
        log(f"reusing random-weight model {out_dir}")
        return str(out_dir)
    from transformers import AutoModelForCausalLM, Qwen3Config
    log(f"building random-weight Qwen3 {shape} in {out_dir}")
    cfg = Qwen3Config(**shape, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
                      initializer_range=INIT_STD)
    torch.manual_seed(0)
    with torch.device(device):                      # random init is much faster on a GPU
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    tmp = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)                      # safetensors; the tied LM head is stored once
    build_tokenizer(shape["vocab_size"]).save_pretrained(tmp)
    tmp.rename(out_dir)                             # renamed last: a partial dir is never reused
    del model
    return str(out_dir)
