"""comm: nccl-tests-grade collective sweeps under torchrun (`ciuic-doctor comm-bench`).

Measures all_reduce (Ring vs Tree), all_gather, reduce_scatter, broadcast and all_to_all: time, algbw and
busbw per size, in- and out-of-place, with an exact correctness check and per-rank times (straggler).
Writes: RUN/comm.jsonl (one record per collective, size and placement, from rank 0) and prints the
nccl-tests-style table.

    bench.py       the sweep on each rank; measure.py  one (collective, size, placement) timed on every rank
    collectives.py buffers and launch; check.py  inputs whose result is exact in any reduction order
    phases.py      process groups and NCCL algorithm forcing; faults.py  naming a dead or hung rank
    table.py       the printed table
"""
