"""Where loader-sweep's dataset comes from: a user's `module:callable`, the job spec, or a synthetic one.

The synthetic dataset models decoding: each sample costs a chosen amount of *CPU time* (a hash loop
measured with the thread's own CPU clock, so under contention it takes longer in wall time, exactly as
a real decoder does) and yields a chosen number of bytes. A `sleep` would not compete for cores, and
worker counts beyond the core count would then look free.

Every way a user can get the dataset wrong ends in one `UserError` line, never a traceback.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import sys
import time
from typing import Any

import torch
from torch.utils.data import Dataset, IterableDataset

from ciuic_doctor.errors import UserError
from ciuic_doctor.probes.loader.measure import one_line

SYNTHETIC_SAMPLES = 100_000  # samples are made on the fly; the length only bounds an epoch
_HASH_CHUNK = b"\x5a" * 4096  # one sha256 over 4 KiB ≈ 5-10 µs: fine-grained enough to stop on time


def busy_cpu(ms: float) -> int:
    """Burn `ms` milliseconds of this thread's CPU time with real work (sha256); returns the rounds."""
    if ms <= 0:
        return 0
    end = time.thread_time() + ms / 1000.0
    digest = hashlib.sha256()
    rounds = 0
    while time.thread_time() < end:
        digest.update(_HASH_CHUNK)
        rounds += 1
    return rounds


class SyntheticDataset(Dataset):
    """`num_samples` samples of `sample_bytes` uint8 each, each costing `sample_cost_ms` of CPU."""

    def __init__(
        self,
        *,
        sample_cost_ms: float = 0.0,
        sample_bytes: int = 4096,
        num_samples: int = SYNTHETIC_SAMPLES,
        seed: int = 0,
    ) -> None:
        self.sample_cost_ms = float(sample_cost_ms)
        self.sample_bytes = int(sample_bytes)
        self.num_samples = int(num_samples)
        self.seed = seed

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> Any:
        busy_cpu(self.sample_cost_ms)
        # Built from a bytearray, not torch.full: torch.full parallelises large fills over intra-op
        # threads, whose spinning made one main-process sample cost 5x its CPU budget on 2 cores.
        return torch.frombuffer(bytearray([(index + self.seed) % 251]) * self.sample_bytes, dtype=torch.uint8)


def load_callable(text: str) -> Any:
    """The Dataset returned by calling `module:callable` (the current directory is importable).

    >>> load_callable("no_colon")
    Traceback (most recent call last):
    ...
    ciuic_doctor.errors.UserError: --dataset 'no_colon': expected module:callable, e.g. mydata:build
    """
    module_name, sep, attr_path = text.partition(":")
    if not sep or not module_name or not attr_path:
        raise UserError(f"--dataset {text!r}: expected module:callable, e.g. mydata:build")
    if os.getcwd() not in sys.path:  # a console script does not put the cwd on sys.path; python -m does
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # any error while importing user code is the user's to fix
        raise UserError(f"--dataset {text}: cannot import {module_name!r} ({one_line(exc)})") from None
    target: Any = module
    for part in attr_path.split("."):
        if not hasattr(target, part):
            raise UserError(f"--dataset {text}: {module_name!r} has no attribute {attr_path!r}")
        target = getattr(target, part)
    if not callable(target):
        raise UserError(f"--dataset {text}: {attr_path!r} is not callable")
    try:
        dataset = target()
    except Exception as exc:
        raise UserError(f"--dataset {text}: calling it raised {one_line(exc)}") from None
    return check_dataset(dataset, f"--dataset {text}")


def check_dataset(dataset: Any, label: str) -> Any:
    """A torch Dataset with at least one sample (map-style) or an IterableDataset; else UserError."""

    if not isinstance(dataset, Dataset):
        raise UserError(f"{label}: returned {type(dataset).__name__}, not a torch.utils.data.Dataset")
    if isinstance(dataset, IterableDataset):
        return dataset
    try:
        length = len(dataset)  # type: ignore[arg-type]
    except TypeError:
        raise UserError(f"{label}: a map-style Dataset needs __len__") from None
    if length < 1:
        raise UserError(f"{label}: the dataset is empty")
    return dataset


def dataset_from_job_spec(spec: Any) -> tuple[Any, str]:
    """The embedded job's dataset (ciuic_doctor.jobs.data) and a label saying where it came from.

    Until the job's data module exists, a synthetic dataset with the job's sample size stands in
    (int64 tokens of seq_len + 1: inputs and shifted labels) and the label says so.
    """
    try:
        from ciuic_doctor.jobs.data import dataset_from_spec
    except ImportError:
        sample_bytes = (spec.batch.seq_len + 1) * 8
        return SyntheticDataset(sample_bytes=sample_bytes, seed=spec.job.seed), "spec (synthetic stand-in)"
    return check_dataset(dataset_from_spec(spec), f"job spec {spec.source}"), f"spec {spec.source}"


def describe(dataset: Any) -> dict[str, Any]:
    """What the records say about a dataset: its type, length and synthetic parameters."""
    info: dict[str, Any] = {"type": f"{type(dataset).__module__}.{type(dataset).__qualname__}"}
    try:
        info["length"] = len(dataset)
    except TypeError:
        info["length"] = None
    if isinstance(dataset, SyntheticDataset):
        info["sample_cost_ms"] = dataset.sample_cost_ms
        info["sample_bytes"] = dataset.sample_bytes
    return info
