"""`ciuic-doctor checkup`'s orchestration: the phase runner (phases.py) and the script form (script.py)."""
