"""The seven tips of the seed article, each checked against the run's measurements.

base      the data types: a tip, its claims, a claim's status and evidence
comm      tips 1-3 (NCCL algorithm, buffers, communication)
training  tips 4-7 (loss scaling, learning rate, data loading, memory)
seed      the one entry point the report calls (`evaluate_tips`)
"""
