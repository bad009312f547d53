"""The statistics every analysis shares, one function per concept.

    trend        Theil–Sen slope, R² and Mann–Kendall z of one series (`robust_trend`), level shifts
    batch_trend  the same fit for many series at once, one grouped vectorised pass (`fit`)
    spikes       spike and divergence detection on a loss or grad-norm curve (no findings)
    scaler       the fp16 loss scaler's story from skipped steps and scale values (no findings)
    signs        whether a loss goes below zero (a policy gradient's): no floor at zero, no level to judge
    grouped      grouped numpy passes: rows already in order, per-group and per-row medians
    rank_blocks  the steps table in blocks of whole ranks; the whole-number rank column

Analyses (memory/, stability/, steps/, ...) and the live view import from here; nothing here imports an
analysis.
"""
