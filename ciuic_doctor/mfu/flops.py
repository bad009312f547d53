"""Training FLOPs per token from a model's own config, in three named conventions, and the peak table.

The same model reads as different MFU depending on what is counted (torchtitan's 6 × active parameters
with unhalved attention, Megatron's explicit GEMMs with causal attention halved): for DeepSeek-V3 at
4,096 tokens the attention term alone is ≈ 61 or ≈ 31 GFLOP/token, against ≈ 220 from the parameters
(docs/mfu.md derives every figure by hand). So every figure here carries the name of its convention:

- `ciuic` (ours): every matrix multiply a token goes through, counted explicitly: MLA's q and kv
  low-rank projections (or MHA/GQA's q, k, v), the output projection, the dense MLPs, the MoE router,
  the top-k routed and the shared experts, the output layer, and the MTP modules the model runs; core
  attention (QKᵀ and AV) **halved for causal masking** (`causal="halved"`, what a causal flash-attention
  kernel computes), or not (`causal="full"`). Norms, softmax and RoPE are not matmuls and not counted.
- `torchtitan`: 6 × (parameters without the embedding, routed experts weighted top_k / n_experts)
  + 6 · layers · heads · (qk_head_dim + v_head_dim) · seq_len, attention **not halved**
  (torchtitan/models/utils.py, get_moe_model_nparams_and_flops / get_dense_model_nparams_and_flops).
- `megatron`: Megatron-LM's `num_floating_point_operations` (megatron/training/training.py): explicit
  GEMMs × 3 (forward, wgrad, dgrad) × 2 (FMA), core attention halved, the router not counted, MTP
  layers counted as extra transformer layers, the logits × (MTP depth + 1).

Training FLOPs are 6 × the multiply-accumulates of the forward pass (2 per MAC, × 3 for the backward's
two GEMMs per forward GEMM); activation recomputation is not useful work and is not counted.

Pure Python: no torch, no transformers (a config is a plain dict of HF field names).

>>> llama = {"model_type": "llama", "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 256,
...          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4}
>>> f = flops_per_token(llama, seq_len=128)
>>> f.torchtitan == 6 * f.shape.active_params(embedding=False) + 6 * 2 * 4 * (16 + 16) * 128
True
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

CONVENTIONS = ("ciuic", "torchtitan", "megatron")
CONVENTION_NOTES = {
    "ciuic": "explicit matmuls (router, MLA low-rank projections, top-k routed + shared experts, output "
    "layer, MTP as run); causal attention halved",
    "ciuic_full": "as ciuic, attention not halved",
    "torchtitan": "6 x active parameters without the embedding (routed experts x top_k/n_experts) "
    "+ 6·L·H·(qk+v)·seq, attention not halved",
    "megatron": "explicit GEMMs x 3 x 2 (router not counted), core attention halved, MTP as extra "
    "layers, logits x (MTP + 1)",
}


class ConfigError(ValueError):
    """The config lacks what a FLOPs count needs, or a size no model has (one line naming the field)."""


# Sizes a config may give, checked before anything is counted or built: a config is data from a run
# directory, and `num_hidden_layers: 1e9` made a billion-entry layer list (analyze ran past 90 s) while
# `hidden_size: 10**200` overflowed a float. The largest published models are far inside these bounds
# (DeepSeek-V3: 61 layers, hidden 7,168, vocab 129,280, 256 experts; Llama 3.1 405B: 126 layers, hidden
# 16,384; contexts up to 10 M tokens).
MAX_LAYERS = 10_000
MAX_SIZE = 1 << 24  # hidden, heads, head dims, ranks, vocabulary, experts, intermediate sizes
MAX_SEQ_LEN = 1 << 30


@dataclass(kw_only=True)
class ModelShape:
    """The sizes a FLOPs count needs, in one vocabulary for every model family."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    n_heads: int
    n_kv_heads: int
    qk_head_dim: int  # per head, rope part included (MLA: nope + rope)
    v_head_dim: int
    dense_layers: int  # layers with a dense MLP
    moe_layers: int  # layers with an MoE MLP
    ffn_size: int  # the dense MLP's intermediate size
    mlp_matrices: int = 3  # SwiGLU: gate, up, down
    # MLA (DeepSeek-V2/V3): low-rank q and kv; kv_lora_rank None means plain MHA/GQA
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int = 0
    # MoE
    n_routed_experts: int = 0
    top_k: int = 0
    moe_ffn_size: int = 0  # one routed expert's intermediate size
    shared_ffn_size: int = 0  # all shared experts together
    mtp_layers: int = 0  # multi-token prediction modules run in training
    tied_embeddings: bool = False

    # ---- multiply-accumulates per token, forward ------------------------------------------------
    def attn_proj_macs(self) -> int:
        """q, k, v (or MLA's low-rank chain) and output projections of one layer."""
        d, h = self.hidden_size, self.n_heads
        if self.kv_lora_rank:
            q = (
                d * self.q_lora_rank + self.q_lora_rank * h * self.qk_head_dim
                if self.q_lora_rank
                else d * h * self.qk_head_dim
            )
            nope = self.qk_head_dim - self.qk_rope_head_dim
            kv = d * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank * h * (
                nope + self.v_head_dim
            )
            return q + kv + h * self.v_head_dim * d
        q = d * h * self.qk_head_dim
        kv = d * self.n_kv_heads * (self.qk_head_dim + self.v_head_dim)
        return q + kv + h * self.v_head_dim * d

    def attn_core_macs(self, seq_len: int, *, causal_halved: bool) -> float:
        """QKᵀ and AV of one layer, per token (a token attends to seq_len keys, half of them causally)."""
        full = self.n_heads * (self.qk_head_dim + self.v_head_dim) * seq_len
        return full / 2 if causal_halved else float(full)

    def dense_mlp_macs(self) -> int:
        return self.mlp_matrices * self.hidden_size * self.ffn_size

    def router_macs(self) -> int:
        return self.hidden_size * self.n_routed_experts if self.moe_layers else 0

    def moe_mlp_macs(self) -> int:
        """Routed (top-k of them) plus shared experts of one MoE layer, without the router."""
        per_expert = self.mlp_matrices * self.hidden_size * self.moe_ffn_size
        return self.top_k * per_expert + self.mlp_matrices * self.hidden_size * self.shared_ffn_size

    def head_macs(self) -> int:
        return self.hidden_size * self.vocab_size

    def mtp_extra_macs(self) -> int:
        """One MTP module besides its transformer layer: the 2d -> d projection (the head is shared)."""
        return 2 * self.hidden_size * self.hidden_size

    # ---- parameter counts ----------------------------------------------------------------------
    def norm_params(self) -> int:
        per_layer = 2 * self.hidden_size + (self.q_lora_rank or 0) + (self.kv_lora_rank or 0)
        return self.num_layers * per_layer + self.hidden_size

    def total_params(self) -> int:
        """Every parameter of the layers run in training (all experts, embedding, head, norms)."""
        expert = self.mlp_matrices * self.hidden_size * self.moe_ffn_size
        moe = self.n_routed_experts * expert + self.mlp_matrices * self.hidden_size * self.shared_ffn_size
        layers = (
            self.num_layers * self.attn_proj_macs()
            + self.dense_layers * self.dense_mlp_macs()
            + self.moe_layers * (moe + self.router_macs())
        )
        embed = self.vocab_size * self.hidden_size
        return layers + embed + (0 if self.tied_embeddings else self.head_macs()) + self.norm_params()

    def active_params(self, *, embedding: bool = True) -> int:
        """Parameters a token uses: routed experts count top_k of n; norms included (torchtitan's count)."""
        layers = (
            self.num_layers * self.attn_proj_macs()
            + self.dense_layers * self.dense_mlp_macs()
            + self.moe_layers * (self.moe_mlp_macs() + self.router_macs())
        )
        embed = self.vocab_size * self.hidden_size
        head = 0 if self.tied_embeddings else self.head_macs()
        if not embedding and self.tied_embeddings:
            return layers + embed + self.norm_params()  # the tied matrix still does the head's matmul
        return layers + head + self.norm_params() + (embed if embedding else 0)


@dataclass(kw_only=True)
class Flops:
    """Training FLOPs per token in each convention at one sequence length; `parts` are ours, itemised."""

    shape: ModelShape
    seq_len: int
    ciuic: float  # explicit matmuls, causal attention halved
    ciuic_full: float  # explicit matmuls, attention not halved
    torchtitan: float
    megatron: float
    parts: dict[str, float]

    def get(self, convention: str) -> float:
        if convention not in CONVENTION_NOTES:
            raise ValueError(f"unknown FLOPs convention {convention!r}; known: {', '.join(CONVENTION_NOTES)}")
        return float(getattr(self, convention))

    def to_dict(self) -> dict[str, Any]:
        return {
            "seq_len": self.seq_len,
            "flops_per_token": {name: self.get(name) for name in CONVENTION_NOTES},
            "conventions": dict(CONVENTION_NOTES),
            "parts": dict(self.parts),
            "active_params": self.shape.active_params(),
            "total_params": self.shape.total_params(),
            "mtp_layers": self.shape.mtp_layers,
        }


def flops_per_token(config: Mapping[str, Any], *, seq_len: int, mtp_layers: int | None = None) -> Flops:
    """FLOPs per trained token of `config` (HF field names) at `seq_len`, in every convention.

    `mtp_layers`: the MTP modules the training actually runs (None: the config's num_nextn_predict_layers;
    transformers' DeepseekV3ForCausalLM builds none, so watch passes 0 for it).
    """
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or not 1 <= seq_len <= MAX_SEQ_LEN:
        raise ConfigError(f"seq_len must be a whole number from 1 to {MAX_SEQ_LEN:,}, not {seq_len!r}")
    if mtp_layers is not None and (
        isinstance(mtp_layers, bool) or not isinstance(mtp_layers, int) or not 0 <= mtp_layers <= MAX_LAYERS
    ):
        raise ConfigError(
            f"the MTP layers run must be a whole number from 0 to {MAX_LAYERS:,}, not {mtp_layers!r}"
        )
    shape = shape_from_config(config, mtp_layers=mtp_layers)
    return _count(shape, seq_len)


def _count(s: ModelShape, seq_len: int) -> Flops:
    layers_run = s.num_layers + s.mtp_layers  # an MTP module holds one transformer layer (an MoE one)
    moe_layers_run = s.moe_layers + (s.mtp_layers if s.moe_layers else 0)
    dense_layers_run = s.dense_layers + (0 if s.moe_layers else s.mtp_layers)
    parts = {
        "attn_proj": 6.0 * layers_run * s.attn_proj_macs(),
        "dense_mlp": 6.0 * dense_layers_run * s.dense_mlp_macs(),
        "moe_experts": 6.0 * moe_layers_run * s.moe_mlp_macs(),
        "router": 6.0 * moe_layers_run * s.router_macs(),
        "head": 6.0 * (1 + s.mtp_layers) * s.head_macs(),
        "mtp_proj": 6.0 * s.mtp_layers * s.mtp_extra_macs(),
        "attn_core_causal": 6.0 * layers_run * s.attn_core_macs(seq_len, causal_halved=True),
    }
    params = sum(v for k, v in parts.items() if k != "attn_core_causal")
    ciuic = params + parts["attn_core_causal"]
    ciuic_full = params + 6.0 * layers_run * s.attn_core_macs(seq_len, causal_halved=False)
    # torchtitan: its models have no MTP; 6 x active non-embedding params + unhalved attention.
    titan = (
        6.0 * s.active_params(embedding=False)
        + 6.0 * s.num_layers * s.n_heads * (s.qk_head_dim + s.v_head_dim) * seq_len
    )
    return Flops(
        shape=s,
        seq_len=seq_len,
        ciuic=ciuic,
        ciuic_full=ciuic_full,
        torchtitan=titan,
        megatron=_megatron(s, seq_len),
        parts=parts,
    )


def _megatron(s: ModelShape, seq_len: int) -> float:
    """Megatron-LM's transformer_flops() per token, as its code reads (router not counted, +1 norm terms)."""
    d, h = s.hidden_size, s.n_heads
    layers = s.num_layers + s.mtp_layers
    moe_layers = s.moe_layers + (s.mtp_layers if s.moe_layers else 0)
    dense_layers = layers - moe_layers
    if s.kv_lora_rank:
        nope, rope = s.qk_head_dim - s.qk_rope_head_dim, s.qk_rope_head_dim
        q_term = s.q_lora_rank * (d + h * (nope + rope) + 1) if s.q_lora_rank else d * h * (nope + rope)
        attn = q_term + s.kv_lora_rank * (d + h * (nope + s.v_head_dim) + 1) + d * rope + h * s.v_head_dim * d
        core = h * (nope + rope) / 2 + h * s.v_head_dim / 2
    else:
        q = s.qk_head_dim * h
        kv = s.qk_head_dim * s.n_kv_heads
        attn = d * (q + 2 * kv) + q * d
        core = q / 2 * 2
    m = s.mlp_matrices
    mlp = d * (s.ffn_size * m * dense_layers + s.moe_ffn_size * s.top_k * m * moe_layers)
    mlp += d * s.shared_ffn_size * m * moe_layers
    mtp = s.mtp_layers * (3 * d + 2 * d * d)
    logits = d * s.vocab_size * (s.mtp_layers + 1)
    return 6.0 * (mlp + attn * layers + mtp + logits) + 6.0 * core * layers * seq_len


# ---- HF configs -> ModelShape ------------------------------------------------------------------------
def _get(config: Mapping[str, Any], *names: str, default: Any = ...) -> Any:
    for name in names:
        value = config.get(name)
        if value is not None:
            return value
    if default is ...:
        raise ConfigError(f"the model config has no {' / '.join(names)}")
    return default


def _int(config: Mapping[str, Any], *names: str, default: Any = ..., maximum: int = MAX_SIZE) -> int:
    value = _get(config, *names, default=default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= maximum:
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:40] + "..."
        raise ConfigError(f"{names[0]} must be a whole number from 0 to {maximum:,}, not {shown}")
    return int(value)


def _moe_pattern(config: Mapping[str, Any], layers: int) -> list[bool]:
    """Which layers have an MoE MLP: DeepSeek's first_k_dense_replace + moe_layer_freq, Qwen-MoE's
    decoder_sparse_step + mlp_only_layers, Mixtral's every layer."""
    if config.get("first_k_dense_replace") is not None or config.get("n_routed_experts") is not None:
        first = _int(config, "first_k_dense_replace", default=0, maximum=MAX_LAYERS)
        freq = _int(config, "moe_layer_freq", default=1, maximum=MAX_LAYERS) or 1
        return [i >= first and i % freq == 0 for i in range(layers)]
    if config.get("decoder_sparse_step") is not None or config.get("mlp_only_layers") is not None:
        step = _int(config, "decoder_sparse_step", default=1, maximum=MAX_LAYERS) or 1
        listed = config.get("mlp_only_layers")
        only = set(listed) if isinstance(listed, list) and len(listed) <= MAX_LAYERS else set()
        return [i not in only and (i + 1) % step == 0 for i in range(layers)]
    return [True] * layers


def shape_from_config(config: Mapping[str, Any], *, mtp_layers: int | None = None) -> ModelShape:
    """A ModelShape from HF config fields: DeepSeek-V2/V3 (MLA + MoE), Mixtral, Qwen2/3-MoE, Llama-style."""
    d = _int(config, "hidden_size", "d_model", "n_embd")
    layers = _int(config, "num_hidden_layers", "n_layer", "num_layers", maximum=MAX_LAYERS)
    heads = _int(config, "num_attention_heads", "n_head")
    if not (d and layers and heads):
        raise ConfigError("hidden_size, num_hidden_layers and num_attention_heads must be positive")
    kv_heads = _int(config, "num_key_value_heads", default=heads) or heads
    vocab = _int(config, "vocab_size")
    experts = _int(config, "n_routed_experts", "num_local_experts", "num_experts", default=0)
    top_k = _int(config, "num_experts_per_tok", "moe_topk", "top_k", default=0) if experts else 0
    pattern = _moe_pattern(config, layers) if experts and top_k else [False] * layers
    moe_layers = sum(pattern)
    kv_lora = _int(config, "kv_lora_rank", default=0)
    if kv_lora:  # MLA
        rope = _int(config, "qk_rope_head_dim")
        qk = _int(config, "qk_nope_head_dim") + rope
        v = _int(config, "v_head_dim")
        q_lora = _int(config, "q_lora_rank", default=0) or None
    else:
        rope, q_lora = 0, None
        qk = v = _int(config, "head_dim", default=d // heads) or d // heads
    dense_ffn = _int(config, "intermediate_size", "ffn_dim", "n_inner", default=4 * d)
    if experts and top_k:
        # Mixtral names the expert size intermediate_size; DeepSeek and Qwen-MoE say moe_intermediate_size.
        moe_ffn = _int(config, "moe_intermediate_size", default=dense_ffn)
        if config.get("n_shared_experts") is not None:
            shared = _int(config, "n_shared_experts") * moe_ffn
        else:
            shared = _int(config, "shared_expert_intermediate_size", default=0)
    else:
        moe_ffn = shared = 0
    if mtp_layers is None:
        mtp_layers = _int(config, "num_nextn_predict_layers", "num_mtp_layers", default=0, maximum=MAX_LAYERS)
    return ModelShape(
        vocab_size=vocab,
        hidden_size=d,
        num_layers=layers,
        n_heads=heads,
        n_kv_heads=kv_heads,
        qk_head_dim=qk,
        v_head_dim=v,
        dense_layers=layers - moe_layers,
        moe_layers=moe_layers,
        ffn_size=dense_ffn,
        q_lora_rank=int(q_lora) if q_lora else None,
        kv_lora_rank=int(kv_lora) if kv_lora else None,
        qk_rope_head_dim=rope,
        n_routed_experts=experts if moe_layers else 0,
        top_k=top_k if moe_layers else 0,
        moe_ffn_size=moe_ffn,
        shared_ffn_size=shared,
        mtp_layers=int(mtp_layers),
        tied_embeddings=bool(config.get("tie_word_embeddings", False)),
    )
