"""What a series is decides how it is judged: adversarial losses, and a model whose gradients are all zero.

- **Adversarial losses.** When one optimizer's loss is computed through another optimizer's parameters
  (a GAN: the generator's loss goes through the discriminator; watch records the pairs in `observed.optim.
  coupled_optimizers` from the losses' autograd graphs), each loss is measured against a moving opponent:
  a generator loss that rises means the discriminator got better, not that training broke (dcgan's G
  loss ends at 1.9x its best on a healthy run). Such series are not judged for divergence by their level;
  non-finite values and spikes still are.
- **A loss below zero** (stats.signs: a policy gradient's −log π × return, a WGAN critic) has no floor
  at zero: "ends 1.5x its best" and "spiked 3x" mean nothing there. The series is named, its divergence and
  loss spikes not judged; a NaN/inf tail still fails, non-finite values and grad-norm spikes still count.
- **Zero is a value.** A loss or a gradient norm of exactly 0.0 (or -0.0) is a measurement. A gradient
  norm that is exactly 0 on every step (MIN_POINTS or more) means the optimizer changes nothing: a loss
  multiplied by 0, a detached graph, frozen parameters. That is said as a warning, never hidden as a
  "no grad norm" not-run.

    >>> import numpy as np
    >>> no_learning_summary(np.zeros(20), np.zeros(20))[:41]
    'the gradient norm is exactly 0 on all 20 '
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ciuic_doctor.analysis.stats.signs import Signs
from ciuic_doctor.rundir.findings import Finding

Curve = Any  # analysis.stability.Curve (not imported: stability imports this module)

PROBE = "stability"
MIN_POINTS = 16  # as the spike and divergence checks: fewer cannot tell a pattern from an accident


def adversarial_divergence(curve: Curve, tail: int | None) -> list[Finding]:
    """The divergence finding of an adversarial series: only a non-finite tail fails it."""
    if tail is not None:
        return [
            Finding(
                probe=PROBE,
                check="divergence",
                verdict="fail",
                summary=f"loss became NaN/inf at step {tail} and stayed so to the end of the log",
                evidence={"nonfinite_tail": True, "onset_step": tail, "adversarial": True},
                where={"step": int(tail)},
            )
        ]
    finite = curve.loss[np.isfinite(curve.loss)]
    said = f" (ends at {finite[-1]:.4g}, best {finite.min():.4g})" if len(finite) >= 2 else ""
    return [
        Finding(
            probe=PROBE,
            check="divergence",
            verdict="pass",
            summary=(
                "an adversarial loss (its optimizer's loss goes through another optimizer's parameters, "
                f"as a GAN's do): not judged by its level{said}; it stayed finite"
            ),
            evidence={"adversarial": True},
        )
    ]


def no_learning(curve: Curve) -> list[Finding]:
    """A warning when every logged gradient norm is exactly zero; nothing otherwise (no finding to add)."""
    norms = curve.grad_norm[np.isfinite(curve.grad_norm)]
    if len(norms) < MIN_POINTS or np.any(norms != 0):
        return []
    loss = curve.loss[np.isfinite(curve.loss)]
    return [
        Finding(
            probe=PROBE,
            check="gradients",
            verdict="warn",
            summary=no_learning_summary(norms, loss),
            evidence={"zero_grad_norm_points": len(norms), "loss_values": _distinct(loss)},
        )
    ]


def no_learning_summary(norms: np.ndarray, loss: np.ndarray) -> str:
    said = f"the gradient norm is exactly 0 on all {len(norms)} logged steps: the optimizer changes nothing"
    values = _distinct(loss)
    if len(values) == 1:
        said += f" and the loss is {values[0]:g} on every step"
    return said + " (a loss multiplied by 0, a detached graph, or frozen parameters?)"


def _distinct(values: np.ndarray) -> list[float]:
    return [float(v) for v in np.unique(values)[:5]]


def signed_findings(signs: Signs, tail: int | None) -> list[Finding]:
    """The divergence and loss_spike findings of a loss below zero: not judged by its level (what the
    series is, said in each), except a NaN/inf tail, which fails divergence."""
    said = signs.describe()
    evidence = {"signed": True, "negative": signs.negative, "points": signs.points}
    if tail is not None:
        divergence = Finding(
            probe=PROBE,
            check="divergence",
            verdict="fail",
            summary=f"loss became NaN/inf at step {tail} and stayed so to the end of the log ({said})",
            evidence={**evidence, "nonfinite_tail": True, "onset_step": tail},
            where={"step": int(tail)},
        )
    else:
        divergence = Finding(
            probe=PROBE,
            check="divergence",
            verdict="not_run",
            summary=f"not judged by its level: {said}",
            evidence=evidence,
        )
    spikes = Finding(
        probe=PROBE,
        check="loss_spike",
        verdict="not_run",
        summary=f"loss spikes not judged by ratio: {said}",
        evidence=evidence,
    )
    return [spikes, divergence]
