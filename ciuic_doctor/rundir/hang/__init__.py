"""Hang dumps in a run directory: the per-rank files watch and `hang` write (`files`), the shapes their
records take (`shapes`), and torch's Flight Recorder dumps (`flight_recorder`)."""
