"""A/A: how often does `verify` call a "change" to the value already in force anything but
"no measurable effect"? The goal (issue 21) is "no measurable effect" in >= 90 % of tries.

    python benchmarks/verify_aa.py                    # 20 tries on the slow-loader test script
    python benchmarks/verify_aa.py --tries 20 --job   # on the embedded job (1 rank; slower)

One recorded run, then --tries independent `verify RUN --try <key>=<the value in force>` calls, each
with its own interleaved A / B rounds. Prints one line per try and the fraction at the end, with the
machine's load average before and after (a shared machine's load is part of the noise being judged).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "tests" / "data" / "user_scripts" / "slow_loader_train.py"


def cli(*args: str, timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("CIUIC_RUN_DIR", None)
    return subprocess.run([sys.executable, "-m", "ciuic_doctor", *args], capture_output=True, text=True,
                          env=env, timeout=timeout, check=False)  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tries", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3, help="A/B rounds per try (default 3)")
    parser.add_argument("--steps", type=int, default=8, help="steps per run after warm-up (default 8)")
    parser.add_argument("--job", action="store_true", help="the embedded job (1 rank) instead of the script")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="verify-aa-"))
    run = root / "run"
    if args.job:
        done = cli("job", "--nproc", "1", "--steps", "6", "--out", str(run), timeout=900)
        key = "dataloader.num_workers=2"  # the embedded job's own
    else:
        done = cli("watch", "--steps", "4", "--out", str(run), "--", str(SCRIPT), timeout=900)
        key = "dataloader.num_workers=0"  # the script's own
    if done.returncode != 0:
        print(done.stdout + done.stderr)
        return 1
    print(f"A/A on {'the embedded job' if args.job else SCRIPT.name}: --try {key}, {args.rounds} rounds of "
          f"{args.steps} steps; load {os.getloadavg()[0]:.1f}")  # fmt: skip
    statuses = []
    started = time.perf_counter()
    for i in range(1, args.tries + 1):
        done = cli("verify", str(run), "--try", key, "--max-rounds", str(args.rounds), "--budget", "3600",
                   "--verify-steps", str(args.steps), timeout=3600)  # fmt: skip
        if done.returncode != 0:
            print(f"try {i}: verify failed: {done.stdout[-500:]}{done.stderr[-500:]}")
            return 1
        cand = json.loads((run / "verification.json").read_text())["candidates"][0]
        statuses.append(cand["status"])
        ratio = cand.get("ratio")
        shown = f"{ratio:.3f} [{cand['ci_low']:.3f}, {cand['ci_high']:.3f}]" if ratio else "-"
        print(f"try {i:2d}: {cand['status']:<21s} {cand.get('target_metric')} B/A {shown}; "
              f"load {os.getloadavg()[0]:.1f}", flush=True)  # fmt: skip
    same = sum(1 for s in statuses if s == "no measurable effect")
    print(
        f"no measurable effect in {same} of {len(statuses)} tries ({same / len(statuses):.0%}; "
        "goal >= 90 %); "
        f"{time.perf_counter() - started:.0f} s; load {os.getloadavg()[0]:.1f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
