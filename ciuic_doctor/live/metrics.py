"""The live view as Prometheus metrics: one endpoint per node, every series labelled with its rank.

Conventions (shared/reference/live-mfu-moe.md, Prometheus naming practice): the `ciuic_` prefix, base
units in names (`_seconds`, `_bytes`, `_watts`, `_ratio`, `_hertz`), counters end in `_total`, labels
`job`, `host`, `rank`, `local_rank`, `gpu` only: never a step, a PID or anything else unbounded. Past
`max_ranks` ranks on one node only the first `max_ranks` in the view's order (ranks needing attention
first, then by rank) get per-rank series; `ciuic_ranks_omitted` says how many did not.

The collector serves the latest sample taken by the sampling thread: a scrape never samples (so a
scrape every second and one every minute cost the job the same), and a scrape of a sample older than
three intervals reports `ciuic_exporter_up 0`. Prometheus renames a scraped `job` label to
`exported_job` unless the scrape config says `honor_labels: true` (deploy/prometheus/ does).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

from ciuic_doctor.live.view import Frame, LiveJob, Row

LABELS = ("job", "host", "rank", "local_rank", "gpu")

# name, type, help, value of a row (None: no sample)
RANK_METRICS: tuple[tuple[str, str, str, Any], ...] = (
    ("ciuic_rank_up", "gauge", "1 while the rank's process is alive", lambda r: int(r.sample.up)),
    ("ciuic_rank_stalled", "gauge", "1 when the rank is stalled (stopped, or no step for 20 median steps)",
     lambda r: int(r.verdict.stalled)),
    ("ciuic_rank_waiting", "gauge", "1 when the rank waits on a stalled rank (no step, but not the culprit)",
     lambda r: int(r.verdict.waiting)),
    ("ciuic_rank_straggler", "gauge", "1 when the rank's pace is >= 10 % behind the typical rank",
     lambda r: int(r.verdict.straggler)),
    ("ciuic_rank_memory_climbing", "gauge", "1 when the rank's RSS rises steadily over the window",
     lambda r: int(r.verdict.memory_climbing)),
    ("ciuic_rank_overflow_storm", "gauge", "1 with >= 5 fp16 skips in the last 100 steps after calibration",
     lambda r: int(r.verdict.overflow_storm)),
    ("ciuic_rank_cpu_seconds_total", "counter", "CPU time of the rank's process",
     lambda r: r.sample.cpu_seconds),
    ("ciuic_rank_resident_memory_bytes", "gauge", "RSS of the rank's process", lambda r: r.sample.rss_bytes),
    ("ciuic_rank_unique_memory_bytes", "gauge", "USS of the rank's process", lambda r: r.sample.uss_bytes),
    ("ciuic_rank_threads", "gauge", "threads of the rank's process", lambda r: r.sample.threads),
    ("ciuic_rank_read_bytes_total", "counter", "bytes read by syscalls: files, pipes, sockets (rchar)",
     lambda r: r.sample.read_bytes),
    ("ciuic_rank_written_bytes_total", "counter", "bytes written by syscalls: files, pipes, sockets (wchar)",
     lambda r: r.sample.write_bytes),
    ("ciuic_rank_workers", "gauge", "DataLoader workers of the rank", lambda r: r.sample.workers),
    ("ciuic_rank_workers_resident_memory_bytes", "gauge", "RSS of the rank's workers together",
     lambda r: r.sample.workers_rss_bytes),
    ("ciuic_rank_steps_total", "counter", "the rank's last optimizer step number (watched jobs)",
     lambda r: r.figures.get("step")),
    ("ciuic_rank_last_step_age_seconds", "gauge", "seconds since the rank's last step",
     lambda r: r.figures.get("since_last_step_s")),
    ("ciuic_rank_step_time_seconds", "gauge", "median step time over the last 50 steps",
     lambda r: r.figures.get("step_time_s")),
    ("ciuic_rank_pre_backward_seconds", "gauge", "median time before backward over the last 50 steps",
     lambda r: r.figures.get("pre_backward_s")),
    ("ciuic_rank_loss", "gauge", "the loss of the rank's last step", lambda r: r.figures.get("loss")),
    ("ciuic_rank_grad_norm", "gauge", "the gradient norm of the last step",
     lambda r: r.figures.get("grad_norm")),
    ("ciuic_rank_loss_scale", "gauge", "the fp16 loss scale of the last step",
     lambda r: r.figures.get("loss_scale")),
    ("ciuic_rank_skipped_steps_total", "counter", "skipped steps seen since the exporter started",
     lambda r: r.figures.get("skipped_seen")),
    ("ciuic_rank_tokens_per_second", "gauge", "tokens the rank trained per second over its last 50 steps",
     lambda r: r.figures.get("tokens_per_s")),
    ("ciuic_rank_tokens_total", "counter",
     "tokens in the step records read since the exporter started (its first look: ~2,000 steps back)",
     lambda r: r.figures.get("tokens_seen")),
)  # fmt: skip

GPU_METRICS: tuple[tuple[str, str, str], ...] = (
    ("ciuic_gpu_utilization_ratio", "utilization_ratio", "GPU busy time share (NVML), 0-1"),
    ("ciuic_gpu_memory_used_bytes", "memory_used_bytes", "device memory used (NVML)"),
    ("ciuic_gpu_power_watts", "power_watts", "board power draw (NVML)"),
    ("ciuic_gpu_sm_clock_hertz", "sm_clock_hertz", "SM clock (NVML)"),
)


@dataclass(kw_only=True)
class ExportConfig:
    job: str
    interval_s: float = 1.0
    max_ranks: int = 256


def labels_of(row: Row, job: str) -> list[str]:
    return [job, row.host, str(row.rank), "" if row.local_rank is None else str(row.local_rank), row.gpu]


class Sampled:
    """The sampling thread and the latest frame; `collect` is what prometheus_client calls on a scrape."""

    def __init__(self, live: LiveJob, config: ExportConfig) -> None:
        self.live = live
        self.config = config
        self.frame: Frame | None = None
        self.sampled_at = 0.0
        self.sample_cpu_s = 0.0
        self.error: str | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()

    def sample_once(self) -> Frame:
        started = time.thread_time()
        frame = self.live.update()
        for row in frame.rows:  # counters need what the window saw, not the window
            window = next(
                (t.windows.get(row.rank) for t in self.live.tails.values() if row.rank in t.windows), None
            )
            row.figures["skipped_seen"] = window.skipped_seen if window is not None else None
            row.figures["tokens_seen"] = (window.tokens_seen or None) if window is not None else None
        with self._lock:
            self.frame, self.sampled_at = frame, time.monotonic()
            self.sample_cpu_s += time.thread_time() - started
        return frame

    def loop(self) -> None:
        while not self._stop.is_set():
            began = time.monotonic()
            self.sample_once()
            self._stop.wait(max(0.0, self.config.interval_s - (time.monotonic() - began)))

    def stop(self) -> None:
        self._stop.set()

    def collect(self) -> list[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        with self._lock:
            frame, age = self.frame, time.monotonic() - self.sampled_at
        families: list[Any] = []
        up = GaugeMetricFamily(
            "ciuic_exporter_up", "1 while the exporter's last sample is fresh", labels=["job"]
        )
        up.add_metric([self.config.job], int(frame is not None and age <= 3 * self.config.interval_s))
        families.append(up)
        cost = CounterMetricFamily(
            "ciuic_exporter_sample_cpu_seconds", "CPU time the exporter spent sampling", labels=["job"]
        )
        cost.add_metric([self.config.job], self.sample_cpu_s)
        families.append(cost)
        if frame is None:
            return families
        # past --max-ranks, the ranks needing attention keep their series first, then the lowest ranks
        rows = sorted(frame.rows, key=lambda r: (r.verdict.severity, r.rank))[: self.config.max_ranks]
        omitted_gauge = GaugeMetricFamily(
            "ciuic_ranks_omitted", "ranks without per-rank series (past --max-ranks)", labels=["job", "host"]
        )
        world = GaugeMetricFamily("ciuic_job_world_size", "WORLD_SIZE of the job", labels=["job"])
        world.add_metric([self.config.job], frame.world_size or len(frame.rows))
        families.append(world)
        kept = {id(r) for r in rows}
        for host in frame.hosts or [self.live.host]:
            left_out = sum(1 for r in frame.rows if r.host == host and id(r) not in kept)
            omitted_gauge.add_metric([self.config.job, host], left_out)
        families.append(omitted_gauge)
        for name, kind, help_text, value_of in RANK_METRICS:
            family_type = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            family_name = name[: -len("_total")] if kind == "counter" else name
            family = family_type(family_name, help_text, labels=LABELS)
            for row in rows:
                value = value_of(row)
                if value is not None:
                    family.add_metric(labels_of(row, self.config.job), float(value))
            if family.samples:  # a figure no rank has (an unwatched job's steps): no empty family
                families.append(family)
        for name, key, help_text in GPU_METRICS:
            family = GaugeMetricFamily(name, help_text, labels=LABELS)
            for row in rows:
                for gpu in row.sample.gpus[:1]:
                    if gpu.get(key) is not None:
                        family.add_metric(labels_of(row, self.config.job), float(gpu[key]))
            if family.samples:
                families.append(family)
        return families


def serve(live: LiveJob, config: ExportConfig, *, port: int, address: str = "127.0.0.1") -> Sampled:
    """Start the HTTP endpoint and the sampling thread; returns the Sampled (call .loop() to run)."""
    from prometheus_client import start_http_server
    from prometheus_client.registry import CollectorRegistry

    sampled = Sampled(live, config)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(sampled)
    sampled.sample_once()
    start_http_server(port, addr=address, registry=registry)
    return sampled
