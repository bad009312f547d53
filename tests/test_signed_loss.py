"""A loss below zero (a policy gradient's): named, judged only where it means something.

pytorch/examples' reinforcement_learning/reinforce.py solves CartPole with one optimizer step per episode
on −Σ log π(a|s) × (normalized return): the loss is negative about as often as positive and its size grows
with the episode (10 steps at first, 500 when solved), and so does each step's time. The records below have
that shape (episode lengths, the loss's sign and size, step times), as watch writes them.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import run_cli

from ciuic_doctor.rundir.store import RunDir


def policy_gradient_run(tmp_path, *, nan_tail: int = 0) -> RunDir:
    rng = np.random.default_rng(543)
    episodes = 260
    length = np.clip(
        10 * np.exp(np.linspace(0, np.log(50), episodes)) * rng.lognormal(0, 0.4, episodes), 8, 500
    )
    loss = rng.normal(0, 1, episodes) * np.sqrt(length) * 0.8  # a sum of zero-mean terms, one per action
    grad = np.sqrt(length) * rng.lognormal(0, 0.3, episodes)
    if nan_tail:
        loss[-nan_tail:] = np.nan
    run = RunDir.create(tmp_path / "run")
    writer = run.writer("steps", rank=0, per_rank_file=True)
    t = 1000.0
    for i in range(episodes):
        step_s = 0.002 * length[i] + 0.01
        t += step_s
        value = "nan" if np.isnan(loss[i]) else float(loss[i])  # watch stores NaN as the string "nan"
        record = {"step": i + 1, "t": t, "step_time_s": step_s, "loss": value, "lr": 0.01, "rank": 0}
        writer.write({**record, "grad_norm": float(grad[i])})
    writer.close()
    return run


def by_check(findings):
    return {f.check: f for f in findings}


def test_a_policy_gradient_loss_is_named_and_not_judged_by_its_level(tmp_path):
    from ciuic_doctor.analysis import stability

    found = by_check(stability.analyze(policy_gradient_run(tmp_path)))
    assert found["divergence"].verdict == "not_run"
    assert "goes below 0" in found["divergence"].summary
    assert "policy-gradient" in found["divergence"].summary
    assert found["loss_spike"].verdict == "not_run"
    assert found["nonfinite_loss"].verdict == "pass"
    assert not [f.summary for f in found.values() if f.verdict in ("warn", "fail")]


def test_a_policy_gradient_loss_that_ends_in_nan_still_fails(tmp_path):
    from ciuic_doctor.analysis import stability

    found = by_check(stability.analyze(policy_gradient_run(tmp_path, nan_tail=5)))
    assert found["divergence"].verdict == "fail"
    assert found["divergence"].where["step"] == 256
    assert found["nonfinite_loss"].verdict == "fail"


def test_longer_episodes_are_not_stalls(tmp_path):
    from ciuic_doctor.analysis import throughput

    goodput = by_check(throughput.analyze(policy_gradient_run(tmp_path)))["goodput"]
    assert goodput.verdict == "pass"
    assert "not stalls" in goodput.summary
    assert "policy gradient" in goodput.summary


@pytest.mark.parametrize("negatives", [0, 1])
def test_a_supervised_loss_with_one_stray_negative_value_is_still_judged(negatives):
    from ciuic_doctor.analysis.stats.signs import below_zero

    loss = np.linspace(3.0, 1.0, 100)
    loss[50 : 50 + negatives] = -0.5
    assert below_zero(loss) is None


# A REINFORCE script of reinforce.py's shape on a toy environment (no gym needed): one optimizer step per
# episode on −Σ log π × normalized return; episodes lengthen as the policy learns to stay in the corridor.
REINFORCE = """
import torch, torch.nn as nn
torch.manual_seed(543)
policy = nn.Sequential(nn.Linear(2, 16), nn.Tanh(), nn.Linear(16, 2))
optimizer = torch.optim.Adam(policy.parameters(), lr=3e-2)
generator = torch.Generator().manual_seed(0)
for episode in range(40):
    position, log_probs, rewards = 0.0, [], []
    for t in range(200):  # the corridor: stay within 3 of the middle; the drift pushes right
        state = torch.tensor([[position, t / 200]])
        dist = torch.distributions.Categorical(logits=policy(state))
        action = dist.sample()
        log_probs.append(dist.log_prob(action))
        position += (1.0 if action.item() else -1.0) * 0.5 + float(torch.randn(1, generator=generator)) * 0.3
        rewards.append(1.0)
        if abs(position) > 3:
            break
    returns, running = [], 0.0
    for r in reversed(rewards):
        running = r + 0.99 * running
        returns.insert(0, running)
    returns = torch.tensor(returns)
    returns = (returns - returns.mean()) / (returns.std() + 1e-6) if len(returns) > 1 else returns * 0
    loss = -(torch.cat(log_probs) * returns).sum()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
"""


@pytest.mark.slow
def test_a_watched_reinforce_script_is_named_not_judged_by_its_loss(tmp_path):
    script = tmp_path / "reinforce_toy.py"
    script.write_text(REINFORCE)
    run = tmp_path / "run"
    run_cli("watch", "--out", str(run), "--", str(script), timeout=600, check=True)
    analyzed = run_cli("analyze", "--json", str(run), timeout=300)
    found = {(f["probe"], f["check"]): f for f in json.loads(analyzed.stdout)}
    assert found[("stability", "divergence")]["verdict"] == "not_run"
    assert "goes below 0" in found[("stability", "divergence")]["summary"]
    assert found[("stability", "loss_spike")]["verdict"] == "not_run"
    assert found[("stability", "nonfinite_loss")]["verdict"] == "pass"
    assert found[("throughput", "goodput")]["verdict"] == "pass"
