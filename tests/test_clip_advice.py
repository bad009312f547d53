"""The clipping advice reasons per optimizer family: clipping nearly every step is a smaller LR for SGD,
not for AdamW, whose step m/√v barely moves with a common gradient scale."""

from __future__ import annotations

from dataclasses import replace

import pytest

from ciuic_doctor.jobs.spec import load_spec
from ciuic_doctor.recommend.core import Context, Plan
from ciuic_doctor.recommend.training import rule_clipping
from ciuic_doctor.rundir.findings import Finding


def _advice(optimizer: str) -> str:
    spec = load_spec()
    spec = replace(spec, optim=replace(spec.optim, name=optimizer, clip_max_norm=0.25))
    finding = Finding(probe="stability", check="clipping", verdict="warn",
                      summary="93% of steps had grad norm above max_norm 0.25",
                      evidence={"suggested_max_norm": 0.59, "clipped_fraction": 0.93, "healthy_p99": 0.58,
                                "based_on": "from 400 steady steps (50–449)"})  # fmt: skip
    plan = Plan()
    rule_clipping(Context(spec=spec, findings=[finding]), plan)
    (rec,) = plan.recommendations
    assert rec.value == 0.59
    return rec.why


@pytest.mark.parametrize("optimizer", ["adamw", "adam"])
def test_adam_family_is_not_told_clipping_is_a_smaller_lr(optimizer):
    why = _advice(optimizer)
    assert "LR" not in why.replace("the LR", "")  # no claim that clipping sets the LR
    assert "Adam family" in why
    assert "moment estimates" in why


def test_sgd_is_told_clipping_is_a_smaller_lr():
    assert "acts as a smaller LR" in _advice("sgd")
