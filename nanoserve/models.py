"""Decoder-only transformer models: Qwen3 and the Llama family (Llama, SmolLM2, Qwen2).

The three architectures are one pre-norm decoder with two switches: Qwen3 RMS-normalizes q and k
per head before rotary (`qk_norm`), Qwen2 has a bias on q, k and v (`qkv_bias`).
Module names follow the Hugging Face checkpoints, except the fused projections: `qkv_proj` packs
q_proj, k_proj, v_proj and `gate_up_proj` packs gate_proj, up_proj; `packed_modules` tells the
weight loader where each checkpoint tensor goes. Owns the architecture, not the file format
(weights.py) nor the batch layout (the forward context in layers.py).
"""
from torch import Tensor, nn
from transformers import PretrainedConfig

from nanoserve import layers


def rope_theta(cfg: PretrainedConfig) -> float:
    """Rotary base, from transformers 5's `rope_parameters` or the older `rope_theta` field."""
    params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"rope scaling {rope_type!r} is not supported: use a plain-rotary model")
    return params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))


class SelfAttention(nn.Module):
    def __init__(self, cfg: PretrainedConfig, backends: layers.Backends) -> None:
        super().__init__()
        tp = layers.tp_rank_and_size()[1]
        D = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        q_size, kv_size = cfg.num_attention_heads * D, cfg.num_key_value_heads * D  # unsharded
        arch = cfg.architectures[0]  # the two switches between architectures (module docstring)
        qk_norm = arch == "Qwen3ForCausalLM"
        qkv_bias = arch == "Qwen2ForCausalLM" or getattr(cfg, "attention_bias", False)
        self.qkv_proj = layers.ColumnParallelLinear(cfg.hidden_size, [q_size, kv_size, kv_size],
                                                    backends, bias=qkv_bias)
        self.o_proj = layers.RowParallelLinear(q_size, cfg.hidden_size, backends)
        self.q_norm = layers.RMSNorm(D, cfg.rms_norm_eps, backends) if qk_norm else None
        self.k_norm = layers.RMSNorm(D, cfg.rms_norm_eps, backends) if qk_norm else None
        self.rotary = layers.RotaryEmbedding(D, cfg.max_position_embeddings, rope_theta(cfg))
        self.attn = layers.Attention(cfg.num_attention_heads // tp,  # H and Hkv on this rank
                                     cfg.num_key_value_heads // tp, D, backends)

    def forward(self, positions: Tensor, x: Tensor) -> Tensor:
        attn = self.attn
        H, Hkv, D = attn.num_heads, attn.num_kv_heads, attn.head_dim
        q, k, v = self.qkv_proj(x).split([H * D, Hkv * D, Hkv * D], -1)
        q, k, v = q.view(-1, H, D), k.view(-1, Hkv, D), v.view(-1, Hkv, D)  # (N, heads, D)
        # q/k norm (Qwen3) -> rotary -> K/V into the paged cache
        q, k = attn.backends.norm_rotary_store(positions, q, k, v, attn, self.rotary,
                                               self.q_norm, self.k_norm)
        o = attn(q, k, v)  # (N, H, D): attend to each sequence's cached context
        return self.o_proj(o.flatten(1))  # (N, hidden)


class MLP(nn.Module):
    def __init__(self, cfg: PretrainedConfig, backends: layers.Backends) -> None:
        super().__init__()
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise ValueError(f"activation {cfg.hidden_act!r} is not supported (only silu)")
        self.gate_up_proj = layers.ColumnParallelLinear(cfg.hidden_size,
                                                        [cfg.intermediate_size] * 2, backends)
        self.down_proj = layers.RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, backends)
        self.silu_and_mul = backends.silu_and_mul

    def forward(self, x: Tensor) -> Tensor:
        # gate and up in one GEMM (N, 2 I) -> SiLU(gate) * up (N, I) -> down (N, hidden)
        return self.down_proj(self.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: PretrainedConfig, backends: layers.Backends) -> None:
        super().__init__()
        self.self_attn, self.mlp = SelfAttention(cfg, backends), MLP(cfg, backends)
        self.input_layernorm = layers.RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backends)
        self.post_attention_layernorm = layers.RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backends)

    def forward(self, positions: Tensor, x: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
        # the residual stream is carried separately so each norm can fuse "add, then normalize"
        x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class DecoderModel(nn.Module):
    """Embedding, layers, final norm; the model runner applies `lm_head` to the hidden states
    (logits of the rows it needs, on rank 0)."""
    packed_modules = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1),
                      "v_proj": ("qkv_proj", 2), "gate_proj": ("gate_up_proj", 0),
                      "up_proj": ("gate_up_proj", 1)}

    def __init__(self, cfg: PretrainedConfig, backends: layers.Backends) -> None:
        """backends: what every layer computes with (the model runner's choice)."""
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = layers.VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size,
                                                                backends)
        self.model.layers = nn.ModuleList(DecoderLayer(cfg, backends)
                                          for _ in range(cfg.num_hidden_layers))
        self.model.norm = layers.RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backends)
        self.lm_head = layers.ParallelLMHead(cfg.vocab_size, cfg.hidden_size, backends)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: Tensor, positions: Tensor) -> Tensor:
        x = self.model.embed_tokens(input_ids)  # (N, hidden)
        residual = x.new_zeros(x.shape)  # the residual stream starts at zero; each layer adds to it
        for layer in self.model.layers:
            x, residual = layer(positions, x, residual)
        return self.model.norm(x, residual)[0]  # (N, hidden)

    def attention_layers(self) -> list[layers.Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]
