"""Pure helpers that probes (while they measure) and analysis (when it judges) both use.

Low in the layers: imports only store/units, never analysis, probes or torch.
"""
