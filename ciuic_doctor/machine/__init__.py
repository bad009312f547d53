"""Facts about the machine a job runs on: the environment capture (`envinfo`), NVML GPU figures (`nvml`) and
NCCL's settings and version (`nccl`). No torch at import; each reader degrades to "unknown" without the
library it reads.
"""
