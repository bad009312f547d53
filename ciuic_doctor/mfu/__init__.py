"""FLOPs per token from a model's own config (flops.py), in named conventions, and the dense peak per
accelerator and dtype (peak.py): what MFU is made of. Pure Python, no torch; part of the floor every layer
may import (ARCHITECTURE.md). The hand derivation the code is held to is docs/mfu.md.
"""
