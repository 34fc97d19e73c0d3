"""CPU tests of bench.py's pure parts: the workload generators, the roofline arithmetic and the PNG
writer. Fast: nothing here loads a model."""
import argparse
import json
import random
import struct
import sys
import zlib
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench  # noqa: E402


def test_w1_is_nano_vllms_workload():
    wl = bench.make_w1()
    assert wl.output_tokens == 133_966
    # the same draws as nano-vllm's bench.py, written with the global random module
    random.seed(0)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, 1024))] for _ in range(256)]
    output_lens = [random.randint(100, 1024) for _ in range(256)]
    assert wl.prompts == prompts and wl.output_lens == output_lens


def test_w2_shares_one_prefix():
    wl = bench.make_w2()
    prefix = wl.prompts[0][:1024]
    assert len(wl.prompts) == 256 and wl.output_lens == [128] * 256
    assert all(p[:1024] == prefix and 32 <= len(p) - 1024 <= 128 for p in wl.prompts)
    assert len({tuple(p[1024:]) for p in wl.prompts}) > 200       # the own tokens differ


def test_build_workloads_scales_and_keeps_defaults():
    args = argparse.Namespace(num_seqs=None, max_input_len=None, max_output_len=None, workload="w1,w2")
    w1, w2 = bench.build_workloads(args, cpu=False)
    assert w1.output_tokens == 133_966 and len(w2.prompts[0]) > 1024
    args = argparse.Namespace(num_seqs=8, max_input_len=50, max_output_len=20, workload="w1,w2")
    w1, w2 = bench.build_workloads(args, cpu=False)
    assert len(w1.prompts) == 8 and all(len(p) <= 50 for p in w1.prompts)
    assert all(n <= 20 for n in w1.output_lens) and w2.output_lens == [20] * 8
    w1, _ = bench.build_workloads(argparse.Namespace(num_seqs=None, max_input_len=None, max_output_len=None,
                                                     workload="w1,w2"), cpu=True)
    assert len(w1.prompts) == 16 and all(32 <= n <= 128 for n in w1.output_lens)


def test_kv_bytes_per_token_qwen3_0_6b():
    cfg = {**bench.QWEN3_0_6B, "dtype": "bfloat16"}
    assert bench.kv_bytes_per_token(cfg) == 2 * 28 * 8 * 128 * 2 == 114_688
    smollm2 = {"hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3, "num_hidden_layers": 30,
               "torch_dtype": "float32"}                                          # head_dim from hidden / heads
    assert bench.kv_bytes_per_token(smollm2) == 2 * 30 * 3 * 64 * 4


def test_decode_bound_hand_computed():
    # weights 100 B, KV 10 B/token, 1 B/s. Prompts 2 and 3 tokens, outputs 1 and 2 tokens.
    # step 0: both run, contexts 2 + 3 -> 100 + 50; step 1: only the second, context 4 -> 100 + 40.
    assert bench.decode_bound_seconds([2, 3], [1, 2], 100, 10, 1.0) == 290
    # one at a time: 100 + 20, then 100 + 30 and 100 + 40
    assert bench.decode_bound_seconds([2, 3], [1, 2], 100, 10, 1.0, max_num_seqs=1) == 390
    assert bench.decode_bound_seconds([2, 3], [1, 2], 100, 10, 2.0) == 145


def test_decode_bound_w1_on_h100_is_plausible():
    wl = bench.make_w1()
    weights = 596_049_920 * 2                       # Qwen3-0.6B parameters in bf16, tied head counted once
    secs = bench.decode_bound_seconds([len(p) for p in wl.prompts], wl.output_lens, weights, 114_688, 3.35e12)
    steps = max(wl.output_lens)                     # 256 <= max_num_seqs: all requests decode together
    assert secs > steps * weights / 3.35e12         # the weights alone, once a step
    assert 5_000 < wl.output_tokens / secs < 50_000


def test_weight_bytes_reads_safetensors_headers(tmp_path):
    from safetensors.torch import save_file
    save_file({"a": torch.zeros(3, 4, dtype=torch.bfloat16), "b": torch.zeros(5)}, str(tmp_path / "m.safetensors"),
              metadata={"format": "pt"})
    assert bench.weight_bytes(str(tmp_path)) == 3 * 4 * 2 + 5 * 4


@pytest.mark.parametrize("name, bandwidth", [("NVIDIA H100 80GB HBM3", 3.35e12), ("NVIDIA H200", 4.8e12),
                                             ("NVIDIA H100 PCIe", 2.0e12), ("NVIDIA GH200 480GB", 4.0e12),
                                             ("NVIDIA L40S", 0.864e12), ("Some Future GPU", None)])
def test_gpu_bandwidth_by_name(name, bandwidth):
    assert bench.gpu_bandwidth(name) == bandwidth


def test_gpu_samples_summarized_over_busy_samples_only():
    samples = ["1980, 2619, 45, 350.0, 0x0000000000000000", "1755, 2619, 52, 450.0, 0x0000000000000004",
               "345, 2619, 40, 70.0, 0x0000000000000001", "garbage line"]
    summary = bench.summarize_gpu(samples)  # the idle sample (power below the median) is left out
    assert summary == ("2 busy samples: SM 1755-1980 MHz, memory 2619-2619 MHz, 45-52 C, 400 W mean, "
                       "event reasons ['0x0000000000000000', '0x0000000000000004']")
    assert bench.summarize_gpu(["[N/A], 2619, 40, 70.0, 0x0"]) is None and bench.summarize_gpu([]) is None
    with bench.gpu_monitor("cpu") as cpu_samples:  # no GPU: no nvidia-smi, no samples
        pass
    assert cpu_samples == []


def test_png_without_matplotlib(tmp_path):
    path = tmp_path / "b.png"
    bench.plot_without_matplotlib(str(path), {"w1": {"nanoserve": 100.0, "hf": 10.0}, "w2": {"nanoserve": 50.0}})
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    idat_len = struct.unpack(">I", data[33:37])[0]
    raw = zlib.decompress(data[41:41 + idat_len])
    assert len(raw) == height * (1 + 3 * width)      # one filter byte + RGB per row


def test_plot_from_json(tmp_path):
    rows = [{"workload": "w1", "engine": "nanoserve", "tokens_per_s": 5.0},
            {"workload": "w1", "engine": "hf", "tokens_per_s": None}]    # a failed engine has no bar
    (tmp_path / "b.json").write_text(json.dumps({"rows": rows}))
    bench.plot(json.loads((tmp_path / "b.json").read_text())["rows"], str(tmp_path / "b.png"))
    assert (tmp_path / "b.png").stat().st_size > 0


def test_build_tiny_random_qwen3(tmp_path):
    """The w1 model path (random Qwen3 + decode-only tokenizer), shrunk to run in seconds on a CPU."""
    from transformers import AutoConfig, AutoTokenizer
    model_dir = bench.build_random_qwen3(tmp_path / "qwen3", bench.QWEN3_TINY, "cpu")
    cfg = AutoConfig.from_pretrained(model_dir)
    assert cfg.architectures == ["Qwen3ForCausalLM"] and cfg.tie_word_embeddings and cfg.eos_token_id == bench.EOS_ID
    tok = AutoTokenizer.from_pretrained(model_dir)
    assert tok.eos_token_id == bench.EOS_ID and tok.decode([5, 7]) == "<5> <7>"
    hidden, vocab = bench.QWEN3_TINY["hidden_size"], bench.QWEN3_TINY["vocab_size"]
    assert vocab * hidden * 2 < bench.weight_bytes(model_dir) < 2 * vocab * hidden * 2  # embedding stored once
    assert bench.build_random_qwen3(tmp_path / "qwen3", bench.QWEN3_TINY, "cpu") == model_dir  # reused
