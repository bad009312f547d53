"""Memory findings from memwatch samples and watch's step records: leaks, fragmentation, non-PyTorch
device memory, DataLoader worker growth, and a verdict on the "call empty_cache periodically" folklore.

Checks (probe "memory"; evidence keys are the contract the report codes against):
- `memory_leak`, per rank and kind (host | device): a robust trend (Theil–Sen, `stats.trend`) after a
  warm-up, against steps when the run has them (samples mapped to their rank's step by time), else
  against time. A leak needs all three: Mann–Kendall z ≥ 3, R² ≥ 0.5, and fitted growth over the
  window ≥ max(16 MiB, 0.5 % of the level) — a flat noisy series fails at least one of them — and,
  against steps, at least 20 steady steps (fewer: not_run saying so; a short checkup's start-up growth
  was a FAIL). Projection:
  host headroom is the machine's available memory at the last sample, shared by every rank leaking on
  that host; device headroom is the device total minus what the rank holds. fail when the projection
  runs out within 24 h, else warn. Host series: memwatch's anon (RSS − file-backed − shmem), else USS,
  else RSS, else the steps' own uss/rss; device series: the steps' mem_allocated, else NVML's bytes.
  Evidence: kind, metric, source, slope_bytes_per_step | slope_bytes_per_s, growth_mb_per_step |
  growth_mb_per_s, r2, mann_kendall_z, points, level_start/end_bytes, limit_bytes, headroom_bytes,
  projected_oom_step (step runs only), projected_oom_s.
- `fragmentation`, from the steps' CUDA allocator fields: alloc retries (the allocator freed its cache
  and retried a failed cudaMalloc: a near-OOM sign) and cache held beyond the step's peak.
  At step end reserved − allocated is mostly next step's activation cache, so the verdict uses reserved
  − peak (memory never in use even at the peak); reserved − allocated is reported as the contract asks.
- `non_pytorch_device_memory`: NVML's per-process bytes − the allocator's reserved bytes at the same
  time (CUDA context, cuBLAS workspaces, NCCL buffers — reference/memory.md) and whether it grows;
  this is the test of the seed's "NCCL buffers accumulate" claim.
- `worker_memory_growth`: USS of each DataLoader worker over time. USS rising while RSS
  stays put is copy-on-read (refcount writes un-share forked pages; pytorch/pytorch#13246).
  These three are judged per rank and reported as one finding over the job (`memory.ranks`): the
  worst rank's evidence flat, plus ranks_checked, ranks_not_run, affected_ranks, worst_rank and
  per_rank ({"rank": {verdict, key figures}}: the affected ranks and the worst few); where.ranks lists
  the affected ranks worst first.
- `empty_cache`: PyTorch's docs say empty_cache does not give PyTorch more memory; it only returns
  cached blocks to the driver. The verdict says whether this run shows anything it could help with.

Sizes in `_mb` keys are MiB (2**20), like every size in ciuic-doctor.
"""

from __future__ import annotations

from functools import partial

from ciuic_doctor.analysis.memory import batch, cuda_figures
from ciuic_doctor.analysis.memory.blocks import run_ahead
from ciuic_doctor.analysis.memory.cuda import cuda_findings
from ciuic_doctor.analysis.memory.data import _Data
from ciuic_doctor.analysis.memory.leaks import leak_findings
from ciuic_doctor.analysis.memory.workers import worker_findings
from ciuic_doctor.rundir.findings import Finding
from ciuic_doctor.rundir.store import RunDir

STREAMS = ("memwatch", "steps")
# the grouped passes the checks make (`memory.blocks.in_blocks`: make, slim), in the order they ask
PASSES = (
    (batch._host_fits, batch.without_points),
    (batch._device_fits, batch.without_points),
    (cuda_figures._fragmentation_figures, None),
    (cuda_figures._non_pytorch_fits, cuda_figures._without_points),
    (partial(batch._steps_fits, name="mem_reserved", ranks=None), batch.without_points),
)
OWN_WORKERS = True  # its per-block passes fork their own workers: the analyses after it may run side by side


def analyze(run: RunDir) -> list[Finding]:
    """Every memory check that the run's records allow; the others say not_run and why."""
    data = _Data(run)
    run_ahead(data, PASSES)  # on a big job, the checks' five grouped passes in one map over the blocks
    return [*leak_findings(data), *cuda_findings(data), *worker_findings(data)]
