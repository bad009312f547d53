"""hang: where every rank of a running (hung) job is, read from outside (`ciuic-doctor hang --pid`).

Measures, once: each rank's Python stacks (py-spy, when installed), process state, and the Flight Recorder
status the ranks dumped. Writes: RUN/hang.rank<R>.json for each rank found, as the watchdog would.

    pid.py     the process tree walk and the per-rank dump
    kernel.py  each thread's /proc wchan/state/stack when py-spy --native cannot look (DDP in backward)
"""
