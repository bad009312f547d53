"""watch: per-step records from inside an unchanged training script (`ciuic-doctor watch -- train.py`).

Measures, per rank and per optimizer step: step time, time before backward, loss, LR, grad norm, loss
scale and skipped steps, memory (host RSS/USS, CUDA allocated/reserved), and every K steps a cross-rank
weight checksum; records what the script configured (`observed`); arms a hang watchdog.
Writes: RUN/steps.rank<R>.jsonl (one record a step), meta.json `observed` and `probes.watch`,
RUN/hang.rank<R>.json (+ .last.json, hang.fr/) when a rank stops making progress.

    session.py    WatchSession: installs the hooks, writes the step records
    hooks.py      the wrappers around torch functions (backward, clip, GradScaler, DDP, Optimizer)
    steps.py      what one step collects; values.py  memory, checksum, deferred device reads
    observe/      the script's settings -> meta.json `observed` (sections, values)
    frameworks.py step numbers from Lightning / HF counters; children.py  ranks the script launches
    target.py     the script, directory or -m module watch runs; exit.py  how the process ended
    sentinel.py   a process of its own recording an end no Python code sees (SIGSEGV, SIGKILL)
    hang/         the hang watchdog (config, poll, last, where); snapshot.py  CUDA allocator history on a leak
"""
