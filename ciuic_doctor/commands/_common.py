"""Argument helpers shared by several sub-commands."""

from __future__ import annotations

import argparse


def add_out(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--out",
        metavar="RUN",
        help="run directory to write into (default: reports/<time>-<command>; created if missing)",
    )


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be greater than 0, got {text}")
    return value
