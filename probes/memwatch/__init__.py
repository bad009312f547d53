"""memwatch: memory of a running job sampled from outside, following its whole process tree.

Measures per process (agent / rank N / DataLoader worker of rank N): RSS, USS (every K samples), CPU and
threads from /proc, and device memory per process from NVML where present. Imports no torch.
Writes: RUN/memwatch.jsonl (one record per sample per process).

    sampler.py   the sampling loop; tree.py  the process tree and roles; proc.py  raw /proc reads
"""
