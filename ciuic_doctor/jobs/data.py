"""The embedded job's data: a deterministic synthetic token stream, served as a real job serves its data.

`SyntheticTokenDataset` is a map-style `Dataset` whose sample `i` is a pure function of `(seed, i)`. So every
DataLoader worker, every rank and every resumed run sees the same tokens for the same index, which is what a
bit-identical resume needs, and no download is ever made. The tokens have structure a model can learn (an
arithmetic progression modulo the vocabulary with a per-sample stride, 10 % of positions replaced by noise),
so the loss falls the way a real loss does instead of sitting at ln(vocab) as uniform noise would.

`make_loader` serves it through `DataLoader` + a `DistributedSampler` that can resume mid-epoch
(`ResumableDistributedSampler.set_position`), with the num_workers / prefetch_factor / pin_memory /
persistent_workers the job spec names. loader-sweep imports `dataset_from_spec` for its default dataset.

>>> ds = SyntheticTokenDataset(vocab_size=100, seq_len=8, num_samples=4, seed=1)
>>> bool((ds[2] == ds[2]).all()), ds[2].shape, ds[2].dtype
(True, torch.Size([8]), torch.int64)
"""

from __future__ import annotations

import functools
import multiprocessing
import multiprocessing.context
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

if TYPE_CHECKING:
    from ciuic_doctor.jobs.spec import JobSpec

DEFAULT_NUM_SAMPLES = 4096  # 256 optimizer steps per epoch at the default 2 ranks x 8 sequences
NOISE_FRACTION = 0.1  # share of positions replaced by a random token: a loss floor above zero
MAX_STRIDE = 8  # strides 1..8: the model must infer each sample's stride from its first tokens


class SyntheticTokenDataset(Dataset):
    """`num_samples` sequences of `seq_len` token ids in [0, vocab_size), sample i a function of (seed, i)."""

    def __init__(self, vocab_size: int, seq_len: int, num_samples: int = DEFAULT_NUM_SAMPLES, seed: int = 0):
        if vocab_size < 2 or seq_len < 2 or num_samples < 1:
            raise ValueError("need vocab_size >= 2, seq_len >= 2 and num_samples >= 1")
        self.vocab_size = vocab_size
        self.seq_len = seq_len
        self.num_samples = num_samples
        self.seed = seed

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> torch.Tensor:
        if not 0 <= index < self.num_samples:
            raise IndexError(index)
        # A fresh generator per index (SeedSequence mixes seed and index): no state shared between
        # workers, so the result cannot depend on which worker served it or in which order.
        rng = np.random.default_rng([self.seed, index])
        start = rng.integers(self.vocab_size)
        stride = rng.integers(1, MAX_STRIDE + 1)
        tokens = (start + stride * np.arange(self.seq_len)) % self.vocab_size
        noisy = rng.random(self.seq_len) < NOISE_FRACTION
        tokens[noisy] = rng.integers(self.vocab_size, size=int(noisy.sum()))
        return torch.from_numpy(tokens.astype(np.int64))


def dataset_from_spec(spec: JobSpec, num_samples: int = DEFAULT_NUM_SAMPLES) -> SyntheticTokenDataset:
    """The job's dataset: vocabulary from [model], sequence length from [batch], seed from [job]."""
    return SyntheticTokenDataset(
        vocab_size=int(spec.model.get("vocab_size", 1024)),
        seq_len=spec.batch.seq_len,
        num_samples=num_samples,
        seed=spec.job.seed,
    )


class ResumableDistributedSampler(DistributedSampler):
    """`DistributedSampler` that can start an epoch part-way through, for exact mid-epoch resume.

    Skipping indices here costs nothing; skipping batches by iterating the loader would load and
    discard them (minutes on a real dataset).
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.start_index = 0

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        self.start_index = 0

    def set_position(self, epoch: int, start_index: int) -> None:
        """Serve epoch `epoch` from this rank's `start_index`-th sample on."""
        self.set_epoch(epoch)
        self.start_index = start_index

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())
        return iter(indices[self.start_index :])

    def __len__(self) -> int:
        return self.num_samples - self.start_index


def worker_context(method: str) -> multiprocessing.context.BaseContext:
    """The multiprocessing context DataLoader workers start from (jobs/default.toml says why not fork).

    forkserver's server imports torch and this module once, so each worker is a cheap fork of a
    process that has them already, rather than a fresh interpreter importing torch (~1.5 s here).
    """
    context = multiprocessing.get_context(method)
    if method == "forkserver":
        context.set_forkserver_preload(["torch", __name__])
    return context


RANK_POLL_S = 1.0  # where there is no pidfd (not Linux, or a kernel before 5.3): how often to look


def die_with_rank(rank_pid: int, worker_id: int) -> None:
    """A DataLoader worker's `worker_init_fn`: end this worker when rank `rank_pid` ends, even by SIGKILL.

    torch's own check in each worker watches the worker's parent, which under forkserver is the
    forkserver; and the forkserver lives while any worker holds its "alive" pipe, which every worker
    does. So after kill -9 of a rank under torchrun (which ends only the process groups of ranks still
    alive) its forkserver, its workers and the resource tracker they keep open lived on for good. A
    worker watching the rank itself ends; then the forkserver reads EOF and ends, and so does the
    tracker. `job --nproc` reaps them as a subreaper too, but torchrun does not."""
    import threading

    try:
        handle: int | None = os.pidfd_open(rank_pid)  # safe against the pid's reuse once it ends
    except ProcessLookupError:
        os._exit(1)  # the rank ended before this worker started
    except (AttributeError, OSError):
        handle = None

    def wait_for_rank() -> None:
        if handle is not None:
            import select

            select.select([handle], [], [])
        else:
            import time

            while _is_alive(rank_pid):
                time.sleep(RANK_POLL_S)
        os._exit(1)  # no clean-up to do: the rank that consumed this worker's batches is gone

    threading.Thread(target=wait_for_rank, name="ciuic-watch-rank", daemon=True).start()


def _is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def make_loader(
    spec: JobSpec, rank: int, world: int, *, dataset: Dataset | None = None
) -> tuple[DataLoader, ResumableDistributedSampler]:
    """The DataLoader of rank `rank` of `world`, configured from spec.dataloader and spec.batch.

    drop_last on both the sampler and the loader: every rank gets the same number of equal batches, so no
    rank waits in an all-reduce for a short last batch that another rank never makes.
    """
    dataset = dataset if dataset is not None else dataset_from_spec(spec)
    sampler = ResumableDistributedSampler(
        dataset, num_replicas=world, rank=rank, shuffle=True, seed=spec.job.seed, drop_last=True
    )
    cfg = spec.dataloader
    workers = cfg.num_workers
    # A generator of its own: creating an iterator draws the workers' base seed from it, not from the
    # global torch RNG, so a resumed run's RNG stream does not depend on when iterators were created.
    generator = torch.Generator().manual_seed(spec.job.seed + rank)
    loader = DataLoader(
        dataset,
        batch_size=spec.batch.per_process,
        sampler=sampler,
        num_workers=workers,
        prefetch_factor=cfg.prefetch_factor if workers > 0 else None,
        persistent_workers=cfg.persistent_workers and workers > 0,
        pin_memory=cfg.pin_memory and torch.cuda.is_available(),
        drop_last=True,
        generator=generator,
        multiprocessing_context=worker_context(cfg.multiprocessing_context) if workers > 0 else None,
        worker_init_fn=functools.partial(die_with_rank, os.getpid()) if workers > 0 else None,
    )
    return loader, sampler


def batches_per_epoch(sampler: ResumableDistributedSampler, batch_size: int) -> int:
    """Full batches one rank serves in one whole epoch."""
    return sampler.num_samples // batch_size
