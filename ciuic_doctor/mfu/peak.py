"""Dense (no sparsity) peak TFLOP/s per accelerator and dtype, for MFU's denominator.

MFU = achieved FLOP/s ÷ peak FLOP/s; the peak is the vendor's dense tensor-core figure for the dtype the
matmuls run in (BF16 for a bf16/fp16 job, as torchtitan and Megatron quote it). Sparse figures are 2 ×
these and never apply to training. Sources (vendor datasheets; dense = the sparse figure / 2):

- A100 (SXM4 and PCIe alike): NVIDIA A100 Tensor Core GPU datasheet: BF16/FP16 312, TF32 156, FP32 19.5.
- H100 SXM5: NVIDIA H100 datasheet: BF16/FP16 989, FP8 1979, TF32 495, FP32 67.
- H100 PCIe: same datasheet: BF16/FP16 756, FP8 1513, TF32 378, FP32 51.
- H100 NVL: same datasheet: BF16/FP16 835, FP8 1671, TF32 418, FP32 60.
- H800 SXM: the H100 SXM die, SM count and clocks (only NVLink / interconnect differ): as H100 SXM.
  H800 PCIe: as H100 PCIe.
- H200 SXM: NVIDIA H200 datasheet: BF16/FP16 989, FP8 1979, TF32 495, FP32 67 (H100 SXM compute).
- H20: NVIDIA HGX H20 product brief: BF16/FP16 148, FP8 296, TF32 74, FP32 44.
- B200: NVIDIA HGX B200 datasheet (8 GPUs: 36 PF BF16, 72 PF FP8, 18 PF TF32 sparse): per GPU dense BF16
  2250, FP8 4500, TF32 1125; FP32 75.
- MI300X: AMD Instinct MI300X datasheet: BF16/FP16 1307, FP8 2615, TF32 654, FP32 163.

A device this table does not know gets no MFU (not_run, with the reason); `--peak-tflops` gives it.

>>> peak_tflops("NVIDIA H200", "bf16").tflops, peak_tflops("NVIDIA H20", "bf16").tflops
(989.0, 148.0)
>>> peak_tflops("NVIDIA GeForce RTX 4090", "bf16").reason.split(" in the table")[0]
'no peak figure for NVIDIA GeForce RTX 4090'
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

# (pattern on the lower-cased device name, table key); first match wins: H200 before H20, NVL/PCIe
# before plain H100 (torch names an H100 SXM "NVIDIA H100 80GB HBM3").
_NAMES: tuple[tuple[str, str], ...] = (
    (r"h200", "H200"),
    (r"h20\b", "H20"),
    (r"h100.*nvl", "H100 NVL"),
    (r"h100.*pcie", "H100 PCIe"),
    (r"h100", "H100 SXM"),
    (r"h800.*pcie", "H800 PCIe"),
    (r"h800", "H800 SXM"),
    (r"\bb200", "B200"),
    (r"a100|a800", "A100"),
    (r"mi300x", "MI300X"),
)
# TFLOP/s, dense: bf16 (fp16 the same), fp8, tf32, fp32
_TABLE: dict[str, dict[str, float | None]] = {
    "A100": {"bf16": 312.0, "fp8": None, "tf32": 156.0, "fp32": 19.5},
    "H100 SXM": {"bf16": 989.0, "fp8": 1979.0, "tf32": 495.0, "fp32": 67.0},
    "H100 PCIe": {"bf16": 756.0, "fp8": 1513.0, "tf32": 378.0, "fp32": 51.0},
    "H100 NVL": {"bf16": 835.0, "fp8": 1671.0, "tf32": 418.0, "fp32": 60.0},
    "H800 SXM": {"bf16": 989.0, "fp8": 1979.0, "tf32": 495.0, "fp32": 67.0},
    "H800 PCIe": {"bf16": 756.0, "fp8": 1513.0, "tf32": 378.0, "fp32": 51.0},
    "H200": {"bf16": 989.0, "fp8": 1979.0, "tf32": 495.0, "fp32": 67.0},
    "H20": {"bf16": 148.0, "fp8": 296.0, "tf32": 74.0, "fp32": 44.0},
    "B200": {"bf16": 2250.0, "fp8": 4500.0, "tf32": 1125.0, "fp32": 75.0},
    "MI300X": {"bf16": 1307.0, "fp8": 2615.0, "tf32": 654.0, "fp32": 163.0},
}
DTYPE_ALIASES = {"bf16": "bf16", "bfloat16": "bf16", "fp16": "bf16", "float16": "bf16", "half": "bf16",
                 "fp8": "fp8", "float8": "fp8", "tf32": "tf32", "fp32": "fp32",
                 "float32": "fp32"}  # fmt: skip
KNOWN = "A100, H100 SXM/PCIe/NVL, H800, H20, H200, B200, MI300X"


@dataclass(kw_only=True)
class Peak:
    tflops: float | None
    device: str | None = None  # the table's key
    dtype: str | None = None
    source: str = "table"  # "table" or "--peak-tflops"
    reason: str | None = None  # why there is no figure


def device_key(name: str) -> str | None:
    lowered = name.lower()
    return next((key for pattern, key in _NAMES if re.search(pattern, lowered)), None)


def peak_tflops(device_name: str | None, dtype: str = "bf16", *, given: float | None = None) -> Peak:
    """The dense peak of `device_name` for `dtype`, or `given` (the user's --peak-tflops) when set."""
    kind = DTYPE_ALIASES.get(dtype.lower(), "bf16")
    if given is not None and not (math.isfinite(given) and given > 0):
        return Peak(tflops=None, device=device_name, dtype=kind, source="--peak-tflops",
                    reason=f"the recorded peak {given!r} TFLOP/s is not a positive number")  # fmt: skip
    if given is not None:
        return Peak(tflops=float(given), device=device_name, dtype=kind, source="--peak-tflops")
    if not device_name:
        return Peak(
            tflops=None, reason="no accelerator recorded (a CPU run): give the peak with --peak-tflops"
        )
    key = device_key(device_name)
    if key is None:
        return Peak(
            tflops=None,
            reason=f"no peak figure for {device_name} in the table ({KNOWN}): give it with --peak-tflops",
        )
    value = _TABLE[key][kind]
    if value is None:
        return Peak(tflops=None, device=key, dtype=kind, reason=f"{key} has no {kind} tensor cores")
    return Peak(tflops=value, device=key, dtype=kind)
