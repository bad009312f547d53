"""The seven tips of the seed article ("分布式训练玄学：在Ciuic上调试DeepSeek的7个神操作"), checked against
this run's measurements.

Each tip is split into the claims it makes; each claim gets a status:
    holds          a measurement of this run agrees with it
    does not hold  a measurement (or a documented PyTorch/NCCL fact) contradicts it
    not measured   nothing in this run can tell (the probe did not run, or the claim needs another setup)
A tip does not hold when any of its claims does not; it holds when at least one claim was measured to hold
and none failed; otherwise it is not measured. The evidence for every status is a sentence with numbers.

The tips live by area in ciuic_doctor.recommend (tips.comm: 1-3, tips_training: 4-7) on the data types of
tips_base; this module is the one entry point.
"""

from __future__ import annotations

from collections.abc import Sequence

from ciuic_doctor.recommend import Context
from ciuic_doctor.recommend.tips.base import FAILS, HOLDS, TIPS, UNMEASURED, Claim, Status, Tip
from ciuic_doctor.recommend.tips.comm import tip1, tip2, tip3
from ciuic_doctor.recommend.tips.training import tip4, tip5, tip6, tip7

__all__ = ["FAILS", "HOLDS", "TIPS", "UNMEASURED", "Claim", "Status", "Tip", "evaluate_tips"]


def evaluate_tips(ctx: Context, *, grad_norms: Sequence[float] = ()) -> list[Tip]:
    """All seven tips, each claim judged by this run's findings (and grad norms from the step records)."""
    return [tip1(ctx), tip2(ctx), tip3(ctx), tip4(ctx), tip5(ctx, grad_norms), tip6(ctx), tip7(ctx)]
