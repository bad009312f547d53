"""checkpoint: what a checkpoint of the job costs and whether a resumed run continues it (`checkpoint-check`).

Measures save time, the other ranks' wait at the barrier, load time and host memory per load way, what a
checkpoint file holds (without unpickling beyond weights_only), and resume fidelity per dropped state.
Writes: RUN/checkpoint.jsonl (cost, inspect, resume and skipped records, per rank).

    check.py   the probe on each rank; cost.py  save/load timing; fidelity.py  resume vs the reference
    inspection.py  what a file holds and whether it loads safely; options.py  --save/--load/--drop
"""
