"""Print the environment capture that every run records in meta.json (secrets redacted)."""

from __future__ import annotations

import argparse
import json

NAME = "env"
HELP = "show what meta.json records about this machine (versions, CPUs, NCCL_* env; secrets redacted)"
ORDER = 90


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--no-torch", action="store_true", help="do not import torch (faster)")


def run(args: argparse.Namespace) -> int:
    from ciuic_doctor.machine.envinfo import capture
    from ciuic_doctor.rundir.store import dumps

    print(json.dumps(json.loads(dumps(capture(with_torch=not args.no_torch))), indent=2))
    return 0
