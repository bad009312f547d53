"""Expert load under watch: how many tokens each MoE router sends to each expert, per layer, step and rank;
and the tokens each step trained (for tokens/s and MFU), with the model's config in meta.json.

Found without any change to the script: a global forward pre-hook sees the first forward of every model
and walks its modules once; it is removed when the first optimizer step ends (a global hook sends every
module call of every step down PyTorch's slow path), so a model first called after that is not seen.
A router is a module named `gate` / `router` beside an `experts` module (transformers' DeepseekV3,
Mixtral, Qwen2-MoE, Qwen3-MoE blocks), or one whose class name ends in Router or Gate (DeepSeek's own
`Gate`, `MoEGate`). Its output is kept when it holds the top-k expert indices (an integer tensor
[tokens, k], as transformers >= 5 routers return) or router logits [tokens, experts] (older gates that
are a Linear: top-k is taken here with the block's top_k); a module whose output is neither is dropped.

Cost: on a sampled step (`moe_every`, default every 10th, and step 1) each router call adds one
`scatter_add_` of its indices into a per-layer counter on the device (no device sync: `bincount` syncs on
CUDA to size its output); at the step's end the counters reach the host through watch's deferred copy
(values.start_copy). Other steps cost one Python call per router. Forwards without grad (evaluation) and
activation-checkpoint recomputation inside backward are not counted: they route no training tokens.

Writes RUN/moe.rank<R>.jsonl: one record per router per sampled step (schemas.SCHEMAS["moe"]):
{step, layer, name, experts, top_k, tokens, calls, counts: [tokens per expert]}, a fixed size of
n_experts integers. Adds `tokens` (the token ids the model's input embedding saw in the step) to each
steps record, and meta.json `model` (class, the config fields a FLOPs count needs, seq_len, MTP layers
run, parameters) from rank 0.
"""

from __future__ import annotations

import os
import re
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ciuic_doctor.probes.watch import module_hooks
from ciuic_doctor.probes.watch.values import PendingQueue, start_copy

STREAM = "moe"
GATE_ATTRS = ("gate", "router")
GATE_CLASS = re.compile(r"(router|gate)$", re.IGNORECASE)
LAYER_IN_NAME = re.compile(r"(?:^|\.)(?:layers|layer|h|blocks|block)\.(\d+)\.")
EXPERT_ATTRS = ("num_experts", "n_routed_experts", "num_local_experts", "n_experts")
TOP_K_ATTRS = ("top_k", "num_experts_per_tok", "topk", "k")
CONFIG_KEYS = (
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
    "shared_expert_intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "n_shared_experts", "n_routed_experts", "num_local_experts", "num_experts",
    "num_experts_per_tok", "first_k_dense_replace", "moe_layer_freq", "decoder_sparse_step",
    "mlp_only_layers", "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
    "n_group", "topk_group", "num_nextn_predict_layers", "tie_word_embeddings",
)  # fmt: skip


@dataclass(kw_only=True)
class Gate:
    """One router: where it is, its sizes, and this sampled step's counter (on the router's device)."""

    name: str
    layer: int
    experts: int | None
    top_k: int | None
    counts: Any = None  # int64 tensor [experts + 1]: the last slot takes "no expert" padding indices
    tokens: int = 0
    calls: int = 0
    checked: bool = False
    hidden: int | None = None  # the width of a token it routes (its weight's [experts, hidden])
    unread: str = ""  # why its output could not be read as expert choices ("" = read, or not yet called)


@dataclass(kw_only=True)
class MoeRecorder:
    session: Any
    every: int = 10
    gates: list[Gate] = field(default_factory=list)
    sampling: bool = True  # the step in progress is sampled (step 1 always is)
    tokens: int = 0
    seq_len: int | None = None
    discovery: Any = None  # the global forward pre-hook, until the first step ends
    _seen: weakref.WeakSet = field(default_factory=weakref.WeakSet)
    _embeddings: weakref.WeakSet = field(default_factory=weakref.WeakSet)
    _handles: list[Any] = field(default_factory=list)
    _queue: PendingQueue | None = None
    _writer: Any = None
    _model_meta: dict[str, Any] | None = None
    _meta_written: bool = False
    _expert_blocks: list[str] = field(default_factory=list)  # modules that hold an experts container
    _status_written: bool = False

    def __post_init__(self) -> None:
        self._queue = PendingQueue(finish=self._write)
        self._pid = os.getpid()

    # ---- discovery -------------------------------------------------------------------------
    def discover(self, module: torch.nn.Module, args: Any) -> None:
        """Global forward pre-hook: the first forward of a model not seen before walks its modules."""
        if module in self._seen:
            return
        self.session._guarded(self._scan, module)

    def _scan(self, root: torch.nn.Module) -> None:
        names = dict(root.named_modules(remove_duplicate=False))
        fresh = [name for name, module in names.items() if module not in self._seen]
        for name in fresh:
            module = names[name]
            self._seen.add(module)
            parent = names.get(name.rpartition(".")[0]) if name else None
            if name and _is_router(name, module, parent):
                self._add_gate(name, module, parent)
            elif name and _is_experts(name, module):
                self._expert_blocks.append(name.rpartition(".")[0] or name)
        embedding = _token_embedding(root) if fresh else None
        if embedding is not None and embedding not in self._embeddings:
            # Hooked on the embedding, not the model: it is called in this very forward (a hook added to
            # the model now would first fire on the next one) and takes the token ids positionally.
            self._embeddings.add(embedding)
            self._handles.append(module_hooks.forward_pre_hook(embedding, self._on_tokens))
            self._model_meta = _model_meta(root)

    def _add_gate(self, name: str, module: torch.nn.Module, parent: torch.nn.Module | None) -> None:
        name = name.removeprefix("module.").removeprefix("_orig_mod.")
        match = LAYER_IN_NAME.search(name + ".")
        gate = Gate(
            name=name,
            layer=int(match.group(1)) if match else len(self.gates),
            experts=_experts(module, parent),
            top_k=_attr_int((module, parent, getattr(parent, "config", None)), TOP_K_ATTRS),
            hidden=_width(module),
        )
        self.gates.append(gate)
        handle = module_hooks.forward_hook(module, lambda m, a, out: self._on_gate(gate, out))
        self._handles.append(handle)

    # ---- per forward -------------------------------------------------------------------------
    def _on_gate(self, gate: Gate, output: Any) -> None:
        if not self.sampling or not torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1:
            return
        indices = _indices(output, gate)
        if indices is None:
            if not gate.checked:  # not a router after all (or one of a shape not read): stop listening
                gate.checked = True
                gate.experts = None
                gate.unread = (
                    f"its output ({_shapes(output)}) holds no [tokens, top_k] expert indices or logits"
                )
            return
        gate.checked = True
        if gate.experts is None:
            return
        flat = indices.reshape(-1)
        if gate.counts is None:
            gate.counts = torch.zeros(gate.experts + 1, dtype=torch.int64, device=flat.device)
        with torch.no_grad():
            gate.counts.scatter_add_(0, flat.clamp(0, gate.experts).to(torch.int64), _ones(flat))
        gate.tokens += int(indices.shape[0])
        gate.calls += 1

    def _on_tokens(self, module: torch.nn.Module, args: tuple) -> None:
        if not torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1:
            return
        ids = args[0] if args else None
        if not isinstance(ids, torch.Tensor) or ids.is_floating_point():
            return
        self.tokens += ids.numel()
        if self.seq_len is None and ids.dim() >= 2:
            self.seq_len = int(ids.shape[-1])
            self.session._guarded(self._write_meta)

    # ---- per step ----------------------------------------------------------------------------
    def on_step(self, step: int, primary: bool) -> dict[str, Any] | None:
        """The step's end (watch's record): queue the sampled counters; the step's tokens for its record."""
        if not primary:
            return None
        self.stop_discovery()  # every model trained has run its forward by now
        if not self._status_written:
            self._status_written = True
            self.session._guarded(self._write_status)
        if self.sampling:
            self._cut(step)
        self.sampling = step % max(1, self.every) == 0  # the next step, step + 1, is 1 + k·every
        tokens, self.tokens = self.tokens, 0
        return {"tokens": tokens} if tokens else None

    def _cut(self, step: int) -> None:
        active = [g for g in self.gates if g.counts is not None]
        if not active:
            return
        lazy = {str(i): g.counts[: g.experts] for i, g in enumerate(active)}
        rows = [
            {"step": step, "layer": g.layer, "name": g.name, "experts": g.experts, "top_k": g.top_k,
             "tokens": g.tokens, "calls": g.calls}
            for g in active
        ]  # fmt: skip
        for gate in active:
            gate.counts, gate.tokens, gate.calls = None, 0, 0
        self._queue.push(start_copy({"rows": rows}, lazy))

    def _write(self, pending: Any) -> None:
        values = pending.values()
        if self._writer is None:
            self._writer = self.session.run.writer(STREAM, rank=self.session.rank, per_rank_file=True)
        for i, row in enumerate(pending.record["rows"]):
            counts = [int(v) for v in values.get(str(i), [])]
            self._writer.write({**row, "rank": self.session.rank, "counts": counts})

    def _write_meta(self) -> None:
        if self._meta_written or self._model_meta is None or self.session.rank != 0:
            return
        self._meta_written = True
        meta = {**self._model_meta, "seq_len": self.seq_len, "routers": len(self.gates)}
        self.session.run.update_meta(model=meta)

    def _write_status(self) -> None:
        """meta.json model.moe after the first step, when the model has experts or routers: which routers
        were read, which were found but not read (and why), and expert blocks without a router found, so
        the analysis can tell "balanced" from "not recorded"."""
        if self.session.rank != 0:
            return
        read = [g.name for g in self.gates if g.experts is not None and g.checked]
        unread = [{"name": g.name, "why": g.unread} for g in self.gates if g.unread]
        routed = {g.name.rpartition(".")[0] for g in self.gates}
        blocks = [b.removeprefix("module.").removeprefix("_orig_mod.") for b in self._expert_blocks]
        without = [b for b in dict.fromkeys(blocks) if b not in routed]
        widths = [g.hidden for g in self.gates if g.hidden]
        if read or unread or without:
            status = {
                "hidden_size": widths[0] if widths else None,
                "routers_read": read[:64],
                "routers_unread": unread[:64],
                "experts_without_router": without[:64],
            }
            self.session.run.update_meta(model={"moe": status})

    def stop_discovery(self) -> None:
        if self.discovery is not None:
            self.discovery.remove()
            self.discovery = None

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if os.getpid() != self._pid:  # a forked child (DataLoader worker): the parent writes these
            return
        if self._queue is not None:
            self._queue.flush()
        if self._writer is not None:
            self._writer.close()
            self._writer = None


# ---- helpers -----------------------------------------------------------------------------------
def _ones(flat: torch.Tensor) -> torch.Tensor:
    return torch.ones((), dtype=torch.int64, device=flat.device).expand(flat.shape)


def _is_router(name: str, module: torch.nn.Module, parent: torch.nn.Module | None) -> bool:
    if isinstance(module, torch.nn.ModuleList | torch.nn.ModuleDict | torch.nn.Sequential):
        return False
    attr = name.rpartition(".")[2]
    if attr in GATE_ATTRS and parent is not None and hasattr(parent, "experts"):
        return True
    return bool(GATE_CLASS.search(type(module).__name__)) and not isinstance(module, torch.nn.Linear)


def _attr_int(owners: tuple[Any, ...], names: tuple[str, ...]) -> int | None:
    for owner in owners:
        for name in names:
            value = getattr(owner, name, None) if owner is not None else None
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def _experts(module: torch.nn.Module, parent: torch.nn.Module | None) -> int | None:
    found = _attr_int((module, getattr(parent, "experts", None), parent), EXPERT_ATTRS)
    if found:
        return found
    weight = getattr(module, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.shape[0] >= 2:
        return int(weight.shape[0])  # a router's weight is [experts, hidden]
    return None


def _indices(output: Any, gate: Gate) -> torch.Tensor | None:
    """The top-k expert indices in a router's output as [tokens, k], or top-k of its logits; None if
    neither. Tokens may come flat ([tokens, k]) or per sequence ([batch, seq, k], [batch, seq, experts]):
    every leading dimension is a token dimension."""
    items = output if isinstance(output, tuple | list) else (output,)
    tensors = [t for t in items if isinstance(t, torch.Tensor) and t.dim() >= 2]
    for t in tensors:
        integer = not t.is_floating_point() and t.dtype != torch.bool
        if integer and (gate.top_k is None or t.shape[-1] == gate.top_k):
            if gate.experts is None:
                logits = next((x for x in tensors if x.is_floating_point()), None)
                gate.experts = int(logits.shape[-1]) if logits is not None else None
            return t.reshape(-1, t.shape[-1])
    logits = next((t for t in tensors if t.is_floating_point() and t.shape[-1] >= 2), None)
    if logits is None or not gate.top_k or gate.top_k >= logits.shape[-1]:
        return None
    if gate.experts is None:
        gate.experts = int(logits.shape[-1])
    with torch.no_grad():
        return logits.reshape(-1, logits.shape[-1]).topk(gate.top_k, dim=-1).indices


def _width(module: torch.nn.Module) -> int | None:
    """A router's input width from its weight [experts, hidden] (comm-bench's bytes per routed token)."""
    weight = getattr(module, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dim() == 2:
        return int(weight.shape[1])
    return None


def _shapes(output: Any) -> str:
    """A router output as the words of a not_run: its tensors' dtypes and shapes."""
    items = output if isinstance(output, tuple | list) else (output,)
    parts = [
        f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"
        if isinstance(t, torch.Tensor)
        else type(t).__name__
        for t in items[:4]
    ]
    return ", ".join(parts) or "nothing"


def _is_experts(name: str, module: torch.nn.Module) -> bool:
    """A container of experts: an `experts` ModuleList/ModuleDict, or one of modules whose class names
    say Expert (a model that calls its router something watch does not recognise still has these)."""
    if not isinstance(module, torch.nn.ModuleList | torch.nn.ModuleDict) or len(module) < 2:
        return False
    return name.rpartition(".")[2] == "experts" or all("expert" in type(m).__name__.lower() for m in module)


def _token_embedding(root: torch.nn.Module) -> torch.nn.Module | None:
    """The model's token embedding: HF's get_input_embeddings(), else its largest nn.Embedding (GPT-2's
    position embedding is smaller than its vocabulary); None for a model without one."""
    model = _unwrap(root)
    getter = getattr(model, "get_input_embeddings", None)
    if callable(getter):
        try:
            found = getter()
        except (NotImplementedError, AttributeError):
            found = None
        if isinstance(found, torch.nn.Embedding):
            return found
    embeddings = [m for m in model.modules() if isinstance(m, torch.nn.Embedding)]
    return max(embeddings, key=lambda m: m.num_embeddings, default=None)


def _unwrap(root: torch.nn.Module) -> torch.nn.Module:
    model = root
    while isinstance(getattr(model, "module", None), torch.nn.Module):
        model = model.module  # DDP / FSDP / DataParallel wrappers
    return model


def _model_meta(root: torch.nn.Module) -> dict[str, Any]:
    model = _unwrap(root)
    config = getattr(model, "config", None)
    to_dict = getattr(config, "to_dict", None)
    values = to_dict() if callable(to_dict) else {}
    kept = {k: values[k] for k in CONFIG_KEYS if isinstance(values.get(k), int | float | bool | str | list)}
    # transformers' models build no multi-token-prediction modules: training runs none of them
    mtp = sum(1 for n, _ in model.named_children() if "mtp" in n.lower())
    return {
        "class": type(model).__name__,
        "config": kept or None,
        "mtp_layers_run": mtp,
        "parameters": sum(p.numel() for p in model.parameters()),
    }


def install(session: Any) -> list[Callable[[], None]]:
    """Start recording; returns the undo callables (watch's session runs them at close)."""
    from torch.nn.modules.module import register_module_forward_pre_hook

    recorder = MoeRecorder(session=session, every=getattr(session.config, "moe_every", 10))
    recorder.discovery = register_module_forward_pre_hook(recorder.discover)
    session.add_step_hook(recorder.on_step)
    return [recorder.stop_discovery, lambda: session._guarded(recorder.close)]
