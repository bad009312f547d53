#!/usr/bin/env bash
# Every CUDA / NVML / NCCL check of ciuic-doctor in one call, for a session that is lent a GPU machine
# (device tool, 15 minutes of device time in all: this script is sized to ~6 minutes on one H200).
#
#   device run:  bash benchmarks/gpu_check.sh        (with timeout_s 540; results land in $OUT)
#
# What it exercises, none of which can run on the CPU-only development machines:
#   1. env capture with torch's CUDA / NCCL view
#   2. comm-bench over NCCL at world size 1 (busbw is 0 by definition there; the point is the NCCL path:
#      NCCL_ALGO set per phase, TUNING log captured and parsed into algo_used)
#   3. the embedded job on CUDA in fp16 + GradScaler (with injected overflows) and in bf16, under watch:
#      the CUDA memory fields of the step records must be filled
#   4. memwatch attached to the fp16 job: NVML per-process GPU memory must be filled
#   5. loader-sweep with an accelerator present (pin_memory is swept only then)
#   6. checkpoint-check on CUDA (save/load timing, resume fidelity incl. the CUDA RNG)
#   7. the analyses and the report of the fp16 run
# A line per step goes to $OUT/summary.txt; logs and run directories are tarred into $OUT/runs.tar.gz
# (the device tool brings back at most 8 files).
# The device image has torch, transformers, pandas, matplotlib, psutil, nvidia-ml-py and jinja2; tomli-w
# (recommended.toml only) may be missing there, in which case the report step says so.
set -u
OUT=${OUT:-/tmp/ciuic-gpu-check}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PY:-python3}
RUNS=$(mktemp -d)
LOGS="$RUNS/logs"
mkdir -p "$LOGS"
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"

step() {  # step NAME LIMIT_S COMMAND...: run with a time limit, log to $LOGS/NAME.log, record the exit code
  local name=$1 limit=$2
  shift 2
  local start=$SECONDS
  timeout "$limit" "$@" >"$LOGS/$name.log" 2>&1
  local rc=$?
  echo "$name: exit $rc in $((SECONDS - start)) s" | tee -a "$SUMMARY"
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >>"$SUMMARY" 2>&1
step env 60 $PY -m ciuic_doctor env
step comm-bench 120 $PY -m ciuic_doctor comm-bench --nproc 1 -b 64K -e 64M -f 4 --out "$RUNS/comm"

$PY -m ciuic_doctor job --nproc 1 --precision fp16 --steps 60 --inject overflow=10:3 \
  --out "$RUNS/fp16" >"$LOGS/job-fp16.log" 2>&1 &
JOB=$!
sleep 2
step memwatch 150 $PY -m ciuic_doctor memwatch --pid "$JOB" --interval 0.2 --out "$RUNS/fp16"
wait "$JOB"
echo "job-fp16: exit $?" | tee -a "$SUMMARY"
step job-bf16 150 $PY -m ciuic_doctor job --nproc 1 --precision bf16 --steps 40 --out "$RUNS/bf16"
step loader-sweep 90 $PY -m ciuic_doctor loader-sweep --budget 30 --out "$RUNS/loader"
step checkpoint-check 150 $PY -m ciuic_doctor checkpoint-check --nproc 1 --out "$RUNS/ckpt"
step report 120 $PY -m ciuic_doctor report "$RUNS/fp16"

# The fields the CPU machines can only test on recorded data: are they filled on a real GPU?
$PY - "$RUNS" >>"$SUMMARY" 2>&1 <<'EOF'
import sys
from pathlib import Path

from ciuic_doctor.rundir.store import RunDir

runs = Path(sys.argv[1])
def filled(run: str, stream: str, fields: list[str]) -> None:
    path = runs / run
    if not path.is_dir():
        print(f"{run}/{stream}: no run directory")
        return
    records = RunDir.open(path).read(stream).records
    for field in fields:
        n = sum(r.get(field) is not None for r in records)
        print(f"{run}/{stream}.{field}: {n}/{len(records)} records filled")

filled("fp16", "steps", ["mem_allocated", "mem_reserved", "mem_active_peak", "alloc_retries", "loss_scale"])
filled("bf16", "steps", ["mem_allocated", "mem_reserved"])
filled("fp16", "memwatch", ["gpu_bytes", "gpu_total_bytes"])
filled("comm", "comm", ["algo_used", "busbw_gbps"])
skipped = [r["step"] for r in RunDir.open(runs / "fp16").read("steps").records if r.get("skipped")]
print(f"fp16 skipped steps (overflow injected at 10-12): {skipped}")
EOF
tar -czf "$OUT/runs.tar.gz" -C "$RUNS" . 2>/dev/null
cat "$SUMMARY"
