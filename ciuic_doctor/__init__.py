"""ciuic-doctor: measure a distributed PyTorch job, judge the measurements, recommend settings.

The package never imports torch, pandas or matplotlib at module level: `ciuic-doctor --help` and
`ciuic-doctor memwatch` must stay light (GUIDE, "Conventions").
"""

__version__ = "0.1.0"
