"""The live view of a running job, attached from outside: every rank found and labelled, sampled from
/proc, NVML and (when watched) its steps streams, judged on a window by the report's rules.

    discover.py  ranks, workers and GPUs of a job from a PID or a run directory (process tree + environ)
    sample.py    per-rank CPU %, RSS/USS, threads, I/O rates, workers, NVML figures
    streams.py   the steps.rank<R>.jsonl tails (new bytes only, size-capped, no symlinks)
    verdicts.py  stalled / waiting / straggler / memory climbing / overflow storm on the window
    view.py      LiveJob.update() -> Frame: the API both fronts use
    render.py, top_app.py   `ciuic-doctor top` (Rich)
    metrics.py, exporter.py `ciuic-doctor export` and `watch --metrics-port` (prometheus_client)

It reads only: no signal is sent, no debugger attached (py-spy's --nonblocking stacks only when asked in
top), and nothing here imports torch.
"""
