"""The seed article's tips as data: each tip's claims with a status (holds / does not hold / not measured)
and the evidence behind it; see ciuic_doctor.recommend.tips.seed for how they are judged."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

Status = Literal["holds", "does not hold", "not measured"]
HOLDS: Status = "holds"
FAILS: Status = "does not hold"
UNMEASURED: Status = "not measured"
SEED_TIMEOUT_S = 30.0
SEED_INIT_SCALE = 2.0**10
SEED_WORKERS = 4


@dataclass(kw_only=True)
class Claim:
    text: str
    status: Status
    evidence: str
    basis: str = "measured"  # measured | documented fact (a claim contradicted by PyTorch/NCCL's own docs)


@dataclass(kw_only=True)
class Tip:
    number: int
    title: str
    original: str  # the article's own heading
    advice: str  # what the article tells you to do, in one line
    claims: list[Claim] = field(default_factory=list)

    @property
    def status(self) -> Status:
        statuses = {c.status for c in self.claims}
        if FAILS in statuses:
            return FAILS
        return HOLDS if HOLDS in statuses else UNMEASURED

    def add(self, text: str, status: Status, evidence: str, basis: str = "measured") -> None:
        self.claims.append(Claim(text=text, status=status, evidence=evidence, basis=basis))

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "status": self.status}


# The article's own headings and what each tip tells you to do.
TIPS: dict[int, tuple[str, str, str]] = {
    1: (
        "Gradient-sync parameters",
        "神操作一：梯度同步的魔法参数调整",
        "init_process_group(timeout=30 s) as an 'increase'; raise GradScaler's init_scale",
    ),
    2: (
        "DataLoader settings",
        "神操作二：数据加载的玄学优化",
        "num_workers=4, pin_memory=True, prefetch_factor=2, persistent_workers=True",
    ),
    3: (
        "NCCL_ALGO=Tree",
        "神操作三：通信优化的隐藏技巧",
        "export NCCL_ALGO=Tree (better on large clusters, > 8 nodes)",
    ),
    4: (
        "LR scaling formula and warm-up",
        "神操作四：学习率调整的神秘公式",
        "effective_lr = base_lr × sqrt(global_batch / reference_batch); OneCycleLR(pct_start=0.1)",
    ),
    5: (
        "Suppressing loss fluctuation",
        "神操作五：损失波动的镇压术",
        "clip_grad_norm_(max_norm=1.0); manual_seed(42 + rank); GradScaler(init_scale=2**10), "
        "higher on multi-GPU",
    ),
    6: (
        "empty_cache against NCCL buffer growth",
        "神操作六：内存泄漏的捉妖记",
        "NCCL buffers accumulate; call torch.cuda.empty_cache() periodically",
    ),
    7: (
        "Checkpoint and resume",
        "神操作七：断点续训的终极方案",
        ("rank 0 saves then barrier; rank 0 loads then broadcast; also save optimizer and scheduler state"),
    ),
}


def new_tip(number: int) -> Tip:
    title, original, advice = TIPS[number]
    return Tip(number=number, title=title, original=original, advice=advice)
