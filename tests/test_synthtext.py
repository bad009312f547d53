"""The generators' vectorised number formatting (tests/synthtext.py) writes the bytes Python's format
does: the large-run generators rely on it to write what the f-string writers wrote."""

from __future__ import annotations

import numpy as np

from tests.synthtext import choose, fixed, integers, text


def test_fixed_and_integers_write_what_format_writes():
    rng = np.random.default_rng(3)
    values = np.concatenate(
        [
            1.76e9 + rng.uniform(0, 3e6, 50_000),  # unix times
            rng.uniform(0, 3, 50_000),  # step times, losses
            rng.exponential(0.5, 50_000),
            np.round(rng.uniform(0, 100, 50_000), 3) + 0.0005,  # near the rounding boundary of 3 decimals
            [0.0, 0.5, 1.5, 2.5, 0.00005, 0.99999, 9.99995],
        ]
    )
    for decimals in (1, 3, 4, 5):
        assert fixed(values, decimals).to_pylist() == [f"{v:.{decimals}f}" for v in values]
    big = 9e9 + rng.uniform(0, 8 * 2**20, 10_000)
    assert integers(big).to_pylist() == [str(int(v)) for v in big]


def test_text_joins_pieces_into_lines():
    mask = np.array([True, False, True])
    body = text([b'{"a":', integers(np.array([1, 2, 3])), b',"b":', choose(mask, "7", "null"), b"}\n"])
    assert body.decode().splitlines() == ['{"a":1,"b":7}', '{"a":2,"b":null}', '{"a":3,"b":7}']
