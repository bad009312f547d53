"""loader: DataLoader throughput sweep for one rank's CPUs (`ciuic-doctor loader-sweep`).

Measures samples/s of num_workers x prefetch_factor (x pin_memory) by successive halving, each in a
forked child a watchdog can kill, with epoch start and worker memory. Writes: RUN/loader.jsonl (one
record per measurement, with its round).

    sweep.py     the halving sweep; measure.py  one measurement in a child
    datasets.py  where the data comes from
"""
