"""The embedded job's model: transformers' `DeepseekV3ForCausalLM` built from the spec's [model] table.

The architecture is DeepSeek-V3's (multi-head latent attention with low-rank q and kv compression, MoE layers
with shared and routed experts and group-limited routing); the size is whatever [model] says, from the
~1 M-parameter default up to the published config. Weights are initialised locally: nothing is downloaded.

Every rank seeds the initialisation with the same `job.seed`. The seed article's
`torch.manual_seed(42 + rank)` gives every rank different weights; DDP hides that by broadcasting rank 0's
weights at construction, but any path without that broadcast (a custom wrapper, a resumed optimizer) then
trains diverged replicas silently — the `rank_desync` check exists to catch it.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

from ciuic_doctor.errors import UserError

if TYPE_CHECKING:
    import torch

    from ciuic_doctor.jobs.spec import JobSpec


def _config_class() -> Any:
    try:
        from transformers import DeepseekV3Config
    except ImportError:
        raise UserError(
            "the embedded job needs transformers with DeepSeek-V3 (>= 4.57): pip install 'ciuic-doctor[job]'"
        ) from None
    return DeepseekV3Config


def model_config(spec: JobSpec) -> Any:
    """A `DeepseekV3Config` from spec.model; unknown keys are a user error (the class would keep them)."""
    config_class = _config_class()
    known = set(inspect.signature(config_class.__init__).parameters) - {"self"}
    unknown = set(spec.model) - known
    if unknown:
        raise UserError(f"[model]: unknown DeepseekV3Config key(s): {', '.join(sorted(unknown))}")
    try:
        # use_cache off: training never reuses the KV cache, and keeping it costs memory every step.
        return config_class(**{**spec.model, "use_cache": False})
    except (TypeError, ValueError) as exc:
        raise UserError(f"[model]: {exc}") from None


def build_model(spec: JobSpec, device: torch.device | str = "cpu") -> torch.nn.Module:
    """A freshly initialised `DeepseekV3ForCausalLM`, identical on every rank (seeded with job.seed)."""
    import torch
    from transformers import DeepseekV3ForCausalLM

    config = model_config(spec)
    torch.manual_seed(spec.job.seed)
    model = DeepseekV3ForCausalLM(config)
    return model.to(device)


def parameter_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
