"""Environment capture for meta.json, and the secret redaction every output goes through.

What is captured: host, OS, Python, torch / CUDA / NCCL / cuDNN versions, devices, CPU count (affinity and
cgroup quota), the distributed world, every NCCL_* / TORCH_* / CUDA_* / PYTORCH_* (and a few more) variable,
and the NCCL config files (/etc/nccl.conf, ~/.nccl.conf, $NCCL_CONF_FILE), which can set NCCL_ALGO without
it showing in os.environ (reference/collectives.md).

Redaction: a variable whose name contains TOKEN, KEY, SECRET, PASSWORD or CREDENTIAL keeps its name and
loses its value; `user:password@` inside a URL becomes `<redacted>@`; and `scrub` removes the *values* of
such variables from any text (raw or JSON-escaped), the values of secret-named command-line flags
(`--hf-token X`, `--api-key=X`) and of secret-named assignments (`HF_TOKEN = "x"`), so a secret echoed
into a log line, an argv or a spec cannot reach a run directory either.

>>> redact_env({"HF_TOKEN": "hf_abc", "NCCL_ALGO": "Ring"})
{'HF_TOKEN': '<redacted>', 'NCCL_ALGO': 'Ring'}
>>> redact_url("https://bob:hunter2@example.com/x")
'https://<redacted>@example.com/x'
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import os
import platform
import re
import socket
import sys
import time
from pathlib import Path
from typing import Any

REDACTED = "<redacted>"
SECRET_NAME_PARTS = ("TOKEN", "KEY", "SECRET", "PASSWORD", "CREDENTIAL")
CAPTURED_PREFIXES = ("NCCL_", "TORCH_", "CUDA_", "PYTORCH_", "OMP_", "MKL_", "GLOO_", "TORCHELASTIC_")
CAPTURED_NAMES = (
    "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
    "MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "CUDA_VISIBLE_DEVICES", "SLURM_JOB_ID",
)  # fmt: skip
# `user[:password]@` up to the *last* @ before the host: a password may hold an @ itself (`p@ss`), which
# the first @ would have cut in two (`https://<redacted>@ss@host/`). JSON escapes (`\"`) may
# sit inside; a '/', whitespace, a quote or an angle bracket ends the authority.
_URL_CREDENTIALS = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)(?:\\.|[^/\s\"<>\\])*@")
_SECRET_WORDS = ("TOKEN", "KEY", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL")
_SECRET_WORD = f"(?:{'|'.join(_SECRET_WORDS)})"
# `--hf-token VALUE`, `--api-key=VALUE`, and the same inside a JSON list (`"--hf-token","VALUE"`): an
# argument passed only on the command line is known by its flag's name, not by any environment value.
_SECRET_FLAG = re.compile(
    rf"(?P<flag>(?<![\w-])--?[\w.-]*{_SECRET_WORD}[\w.-]*)(?P<sep>=|\s+|\"\s*,\s*\")"
    r"(?P<value>(?!-)(?:\\.|[^\s\"\\])+)",
    re.IGNORECASE,
)
# `HF_TOKEN = "v"` (TOML), `"HF_TOKEN": "v"` (JSON), `HF_TOKEN=v` (shell, conf, logs): a value set under a
# secret-looking variable name anywhere, e.g. the spec's [distributed.env], never in os.environ here.
_SECRET_ASSIGNMENT = re.compile(
    rf"(?P<name>\b[A-Z0-9_]*{_SECRET_WORD}[A-Z0-9_]*\b)(?P<sep>\"?\s*[:=]\s*)"
    r"(?P<value>\"(?:\\.|[^\"\\])*\"|'[^'\n]*'|(?<==)[^\s\"',;]+)"
)
_FLAG_HINT = re.compile(rf"-[\w.-]*{_SECRET_WORD}", re.IGNORECASE)  # what every _SECRET_FLAG match holds
_MIN_SECRET_LEN = 4  # shorter values ("1", "yes") would scrub ordinary text; no real secret is that short


def is_secret_name(name: str) -> bool:
    upper = name.upper()
    return any(part in upper for part in SECRET_NAME_PARTS)


def redact_url(text: str) -> str:
    """Replace `user[:password]@` in every URL inside `text`.

    >>> redact_url("https://u:p@ss@host/x")
    'https://<redacted>@host/x'
    """
    return _URL_CREDENTIALS.sub(lambda m: f"{m.group('scheme')}{REDACTED}@", text)


def redact_env(env: dict[str, str]) -> dict[str, str]:
    """Secret-named variables lose their value; every other value loses URL credentials."""
    return {k: REDACTED if is_secret_name(k) else redact_url(v) for k, v in env.items()}


def redact_argv(argv: list[str]) -> list[str]:
    """A command line with the values of secret-named flags and URL credentials removed.

    >>> redact_argv(["train.py", "--hf-token", "hf_abc", "--api-key=xyz", "--lr", "1"])
    ['train.py', '--hf-token', '<redacted>', '--api-key=<redacted>', '--lr', '1']
    """
    out: list[str] = []
    hide_next = False
    for arg in argv:
        if hide_next and not arg.startswith("-"):
            out.append(REDACTED)
            hide_next = False
            continue
        flag, eq, _ = arg.partition("=")
        secret_flag = arg.startswith("-") and is_secret_name(flag)
        hide_next = secret_flag and not eq
        out.append(f"{flag}={REDACTED}" if secret_flag and eq else redact_url(arg))
    return out


@functools.lru_cache(maxsize=4)
def _secret_values(environ_key: tuple[tuple[str, str], ...]) -> tuple[str, ...]:
    """Each secret value in every form it can take in a file: raw, JSON-escaped with `\\uXXXX` (our JSON
    lines), and JSON-escaped with the UTF-8 kept (indent=2 files). A value holding `"`, `\\` or non-ASCII
    differs in those forms, and only the raw one was matched before."""
    import json

    values: set[str] = set()
    for _, value in environ_key:
        if len(value) >= _MIN_SECRET_LEN:
            values |= {value, json.dumps(value)[1:-1], json.dumps(value, ensure_ascii=False)[1:-1]}
    return tuple(sorted(values, key=len, reverse=True))


_ENVIRON_CACHE: dict[str, Any] = {"key": None, "secrets": ()}


def _environ_secrets() -> tuple[tuple[str, str], ...]:
    """Secret-named variables of os.environ, re-read when its size changes and at most once a second:
    a launcher adds the spec's [distributed.env] after start, and a full scan costs ~0.1 ms, too much
    for every record memwatch writes at 10 Hz."""
    key = (len(os.environ), int(time.monotonic()))
    if _ENVIRON_CACHE["key"] != key:
        _ENVIRON_CACHE["secrets"] = tuple(sorted((k, v) for k, v in os.environ.items() if is_secret_name(k)))
        _ENVIRON_CACHE["key"] = key
    return _ENVIRON_CACHE["secrets"]


def _hide_assignment(match: re.Match[str]) -> str:
    value = match.group("value")
    hidden = f"{value[0]}{REDACTED}{value[0]}" if value[0] in "\"'" else REDACTED
    return f"{match.group('name')}{match.group('sep')}{hidden}"


def _has_secret_word(text: str) -> bool:
    """A secret word in capitals is in `text` (what every _SECRET_ASSIGNMENT match holds). Six substring
    searches: the same answer as searching for the regex alternation, which scanned a 500-character step
    record at ~12 us (the six take ~1.5 us)."""
    return any(map(text.__contains__, _SECRET_WORDS))


def scrub(text: str) -> str:
    """Remove secrets from any text before it is written: secret environment values (in raw and
    JSON-escaped form), values of secret-named flags and variables, and URL credentials.

    >>> scrub('"argv":["train.py","--hf-token","hf_abc"]')
    '"argv":["train.py","--hf-token","<redacted>"]'
    >>> scrub('HF_TOKEN = "hf_abc"')
    'HF_TOKEN = "<redacted>"'
    """
    for value in _secret_values(_environ_secrets()):
        if value in text:
            text = text.replace(value, REDACTED)
    # Each pattern runs only where its necessary part is in the text: a dash before a secret word (any
    # case) for a flag, the word in capitals for an assignment. A step record's `"tokens":` key made
    # both run on every record: ~300 us a watched step, for text that cannot match either.
    if _FLAG_HINT.search(text):
        text = _SECRET_FLAG.sub(lambda m: f"{m.group('flag')}{m.group('sep')}{REDACTED}", text)
    if _has_secret_word(text):
        text = _SECRET_ASSIGNMENT.sub(_hide_assignment, text)
    return redact_url(text) if "@" in text else text


def _read_conf(path: Path) -> dict[str, str] | None:
    """NCCL conf files are `NAME=value` lines; `#` starts a comment."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return None
    entries: dict[str, str] = {}
    for raw_line in text.splitlines():
        line = raw_line.split("#", 1)[0].strip()
        if "=" in line:
            name, value = line.split("=", 1)
            entries[name.strip()] = value.strip()
    return redact_env(entries)


def nccl_conf_files() -> dict[str, dict[str, str]]:
    candidates = [Path("/etc/nccl.conf"), Path.home() / ".nccl.conf"]
    if os.environ.get("NCCL_CONF_FILE"):
        candidates.append(Path(os.environ["NCCL_CONF_FILE"]))
    found = {}
    for path in candidates:
        entries = _read_conf(path)
        if entries is not None:
            found[str(path)] = entries
    return found


def cgroup_cpu_quota() -> float | None:
    """CPUs allowed by the cgroup (v2 `cpu.max`, else v1 cfs quota/period); None when unlimited."""
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        base = Path("/sys/fs/cgroup/cpu")
        quota_us = int((base / "cpu.cfs_quota_us").read_text())
        period_us = int((base / "cpu.cfs_period_us").read_text())
        return None if quota_us <= 0 else quota_us / period_us
    except (OSError, ValueError):
        return None


def cpu_budget() -> dict[str, Any]:
    """CPU counts: logical, affinity (taskset/cpuset), cgroup quota, and the usable minimum."""
    logical = os.cpu_count() or 1
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else logical
    quota = cgroup_cpu_quota()
    usable = min(affinity, int(quota)) if quota is not None else affinity
    return {"logical": logical, "affinity": affinity, "cgroup_quota": quota, "usable": max(1, usable)}


def _package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def torch_info() -> dict[str, Any]:
    """torch / CUDA / NCCL / cuDNN versions and CUDA devices. Imports torch: call it only from a
    process that has torch anyway (probes, job), never from the CLI front or memwatch."""
    import torch

    info: dict[str, Any] = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "nccl": None,
        "cudnn": None,
        "devices": [],
    }
    if torch.cuda.is_available():
        with contextlib.suppress(RuntimeError, AttributeError):
            info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        info["cudnn"] = torch.backends.cudnn.version()
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            info["devices"].append(
                {"index": index, "name": props.name, "total_memory_bytes": props.total_memory}
            )
    return info


def capture(*, with_torch: bool = True) -> dict[str, Any]:
    """Everything meta.json records about where a run happened, secrets redacted.

    `with_torch=False` reads torch's version from package metadata without importing it (memwatch).
    """
    env = {
        k: v for k, v in sorted(os.environ.items()) if k.startswith(CAPTURED_PREFIXES) or k in CAPTURED_NAMES
    }
    info: dict[str, Any] = {
        "host": socket.gethostname(),
        "os": platform.platform(),
        "python": sys.version.split()[0],
        "executable": sys.executable,
        "cpu": cpu_budget(),
        "world": {
            key.lower(): int(os.environ[key])
            for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
            if os.environ.get(key, "").isdigit()
        },
        "env": redact_env(env),
        "nccl_conf": nccl_conf_files(),
        "packages": {
            name: _package_version(name)
            for name in ("torch", "transformers", "numpy", "psutil", "nvidia-ml-py", "pandas")
        },
    }
    if with_torch:
        try:
            info.update(torch_info())
        except ImportError:
            info["torch"] = None
    else:
        info["torch"] = info["packages"]["torch"]
    return info
