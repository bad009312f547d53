"""The statistics of `compare`: calibrated on real step times, not only on textbook series.

The false-positive rate is shown on a real step-time series of the embedded job (tests/data/compare/,
recorded with `ciuic-doctor job --steps 240`; see its README): pairs of 40-step series drawn from it by
blocks, so both members of a pair come from the same job under the same settings, with the recording's own
autocorrelation. benchmarks/compare_fpr.py repeats this with more pairs and on fresh runs.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from ciuic_doctor.compare.change import Change, judge_family, percent
from ciuic_doctor.compare.stats import (
    block_length,
    circular_block_indices,
    count_test,
    holm,
    mean_difference,
    ratio_of_means,
    t_cdf,
    t_quantile,
)

RECORDED = Path(__file__).parent / "data" / "compare" / "step_times.json"
PAIRS = 200
STEPS = 40  # the embedded job's default length
SOURCE_BLOCK = 8
SLOWER = 1.5  # blocks drawn from the recording keep its autocorrelation over 8 steps


def _recorded() -> np.ndarray:
    return np.asarray(json.loads(RECORDED.read_text())["step_time_s"], dtype=float)


def _null_pairs(series: np.ndarray, pairs: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    idx = circular_block_indices(len(series), SOURCE_BLOCK, 2 * pairs, rng)[:, :STEPS]
    draws = series[idx]
    return [(draws[2 * i], draws[2 * i + 1]) for i in range(pairs)]


def test_false_positive_rate_on_recorded_step_times_is_near_nominal():
    series = _recorded()
    assert len(series) >= 200, "the recording should hold a long run"
    hits = sum(
        ratio_of_means(a, b, seed=i).p_value < 0.05 for i, (a, b) in enumerate(_null_pairs(series, PAIRS, 7))
    )
    rate = hits / PAIRS
    # Nominal 5 %; 200 pairs put a binomial standard error of 1.5 % on the estimate. Single-step resampling
    # (the mistake this guards against) gives several times the nominal rate on this series.
    assert rate <= 0.10, f"false-positive rate {rate:.1%} at nominal 5 %"
    naive = sum(
        ratio_of_means(a, b, seed=i, blocks=False).p_value < 0.05
        for i, (a, b) in enumerate(_null_pairs(series, PAIRS, 7))
    )
    assert naive / PAIRS > rate, "ignoring autocorrelation should call more noise a change"


def test_known_slowdown_on_recorded_step_times_is_found_with_a_covering_interval():
    series = _recorded()
    covered = found = 0
    for i, (a, b) in enumerate(_null_pairs(series, 100, 11)):
        est = ratio_of_means(a, b * SLOWER, seed=i)  # every step of B 50 % slower
        expected = SLOWER * b.mean() / a.mean()  # the ratio of these two samples' levels
        covered += est.ci_low <= SLOWER <= est.ci_high
        found += est.p_value < 0.05 and est.ratio > 1
        assert math.isclose(est.ratio, expected)
    assert covered >= 88, f"the 95 % interval covered the true +50 % in {covered} of 100"
    # This recording is noisy (step times 0.20-0.49 s between the 5th and 95th percentile, load from other
    # test suites); 40 steps of it find a +50 % change about 3 times in 4.
    assert found >= 60, f"a +50 % slowdown found in only {found} of 100 pairs of 40 steps"


def test_block_length_follows_the_autocorrelation():
    rng = np.random.default_rng(3)
    white = rng.standard_normal(400)
    ar = np.zeros(400)
    for t in range(1, 400):
        ar[t] = 0.8 * ar[t - 1] + rng.standard_normal()
    assert block_length(white) <= 3
    assert block_length(ar) > 2 * block_length(white)
    assert block_length([1.0] * 50) == 1  # no variance: nothing to resample
    assert block_length([1.0, 2.0, 3.0]) == 1  # too short to judge


def test_circular_blocks_are_consecutive_and_wrap():
    rng = np.random.default_rng(0)
    idx = circular_block_indices(10, 4, 50, rng)
    assert idx.shape == (50, 10)
    steps = np.diff(idx[:, :4], axis=1) % 10
    assert (steps == 1).all()


def test_ratio_refuses_too_few_or_non_positive_values():
    with pytest.raises(ValueError, match="at least"):
        ratio_of_means([1.0, 2.0], [1.0, 2.0, 3.0, 4.0, 5.0])
    with pytest.raises(ValueError, match="positive"):
        ratio_of_means([0.0] * 10, [1.0] * 10)


def test_identical_series_give_ratio_one_and_no_change():
    a = np.linspace(0.1, 0.2, 30)
    est = ratio_of_means(a, a)
    assert est.ratio == 1.0
    assert est.ci_low < 1.0 < est.ci_high
    assert est.p_value > 0.9


def test_same_seed_same_interval():
    rng = np.random.default_rng(5)
    a, b = rng.random(50) + 1, rng.random(50) + 1.1
    assert ratio_of_means(a, b) == ratio_of_means(a, b)


def test_t_distribution_matches_tables():
    # Student's t table: t_{0.975}(1) = 12.706, (5) = 2.571, (30) = 2.042; cdf(0) = 0.5 for any df.
    for df, expected in ((1, 12.706), (5, 2.571), (30, 2.042)):
        assert t_quantile(0.975, df) == pytest.approx(expected, abs=1e-3)
    assert t_cdf(0.0, 7) == pytest.approx(0.5)
    assert t_cdf(-2.0, 4) == pytest.approx(1 - t_cdf(2.0, 4))


def test_holm_is_step_down_and_monotone():
    assert holm([0.01, 0.04, 0.03, 0.5]) == [0.04, 0.09, 0.09, 0.5]
    assert holm([]) == []


def test_count_test():
    assert count_test(0, 40, 0, 40) == 1.0
    assert count_test(0, 100, 10, 100) < 0.01
    assert count_test(3, 100, 4, 100) > 0.5


def test_mean_difference_of_paired_series():
    rng = np.random.default_rng(2)
    noise = rng.standard_normal(60) * 0.01
    mean, low, high, p = mean_difference(noise + 0.05)
    assert low < 0.05 < high
    assert p < 0.05
    assert mean == pytest.approx(0.05 + noise.mean())


def test_holm_family_wording():
    rows = [
        Change(check="busbw", metric="busbw", scope=f"size {i}", unit="GB/s", ratio=1.01, p_value=0.02)
        for i in range(5)
    ]
    judge_family(rows)
    # 0.02 alone is significant at 5 %; five of them together are not (Holm: 5 × 0.02 = 0.1).
    assert not any(r.significant for r in rows)
    assert rows[0].family == 5
    assert percent(0.88) == "−12 %"
    assert percent(1.0) == "±0 %"


@pytest.mark.parametrize(
    ("a", "b", "words"),
    [
        (10.0, 5e-324, "run B's level 4.94e-324 is not a measurement"),
        (5e-324, 0.1, "run A's level 4.94e-324 is not a measurement"),
        (1e-6, 1e6, "apart: not one job's measurements"),
    ],
)
def test_a_ratio_of_levels_no_job_measures_is_refused_in_words(a, b, words):
    """A step time of 5e-324 s made the ratio underflow to 0 and compare said "math domain error"."""
    xa = np.full(40, a) * np.linspace(1.0, 1.01, 40)
    xb = np.full(40, b) * np.linspace(1.0, 1.01, 40)
    with pytest.raises(ValueError, match=words):
        ratio_of_means(xa, xb)
