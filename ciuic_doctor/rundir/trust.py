"""What a run directory may make run: a recorded command only when this user recorded it, and an
environment only of the variables a training job is tuned by.

A run directory is data on a shared file system: anyone with write access can change its meta.json,
and `verify` re-runs the command meta.json names. The rule is the one people already trust elsewhere:

- **Jupyter notebook signing**: each notebook Jupyter saves is signed (HMAC-SHA256) with a secret kept in
  the user's own data directory, and its outputs run only when the signature matches. Here `watch` and
  `job` (and so `checkup`, which runs one of them) sign the re-runnable part of meta.json with a key kept
  in the user's config directory; `verify` re-runs a signed command without asking.
- **direnv allow**: an `.envrc` runs only after the user allowed that exact content. Here anything not
  signed by this user's key (a colleague's run, an edited or planted meta.json) runs only after `verify`
  shows the exact argv, working directory and environment and the user says yes (`--yes`, or `y` on a
  terminal).
- **git safe.directory** (git 2.35.2, CVE-2022-24765): git refuses a repository owned by someone else.
  Here a run directory owned by another user, or writable by group or others, is refused unless `--yes`.

What is signed is the canonical JSON (sorted keys, no spaces, ASCII) of every meta.json field `verify`
reads to decide what runs, per kind of job (`SIGNED`): for a watched script its argv, working directory,
rank count and `--set` items; for the embedded job its spec (with its [distributed.env]), world size,
injected faults and backend. The signer signs the values it wrote itself, never values read back from
a meta.json that was already there, so writing into a planted run signs nothing of the planter's.

The key is 32 random bytes (hex) in `$XDG_CONFIG_HOME/ciuic-doctor/key` (default
`~/.config/ciuic-doctor/key`), created 0600 in a 0700 folder; a key that is a symlink, readable by group or
others, or owned by someone else is refused (as ssh refuses such a private key), and nothing is signed.

The environment a spec or a run hands a job is limited by name (`env_refusal`): only the families that
tune collectives, threads and the allocator, never what changes which code runs (PYTHONPATH, LD_PRELOAD,
PATH, BASH_ENV, PROMPT_COMMAND, an NCCL plugin).

Standard library only (the store and `--help` import the run-directory layer).

>>> values = {"argv": ["train.py", "--lr", "3e-4"], "cwd": "/work", "nproc": 2}
>>> canonical(values)
b'{"argv":["train.py","--lr","3e-4"],"cwd":"/work","nproc":2}'
>>> sig = mac(b"k" * 32, "watch", values)
>>> sig == mac(b"k" * 32, "watch", {**values, "nproc": 2})
True
>>> sig == mac(b"k" * 32, "watch", {**values, "nproc": 3})
False
>>> sig == mac(b"k" * 32, "job", values)  # a watch signature is no job signature
False
>>> recorded({"probes": {"watch": {"argv": ["t.py"], "cwd": "/w", "status": "finished"}}}, "watch")
{'argv': ['t.py'], 'cwd': '/w'}
>>> env_refusal("NCCL_ALGO"), env_refusal("PYTORCH_CUDA_ALLOC_CONF")
(None, None)
>>> env_refusal("LD_PRELOAD")
'not a training setting (only NCCL_*, TORCH_*, GLOO_*, CUDA_*, OMP_*, MKL_*, PYTORCH_* and a few exact names)'
>>> env_refusal("NCCL_NET_PLUGIN")
'loads a library named by the value'
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import stat
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

SCHEME = "hmac-sha256"
KEY_BYTES = 32  # as Jupyter's notebook secret: 32 random bytes, 256 bits
MAX_KEY_FILE_BYTES = 4096

# The meta.json paths verify reads to decide what runs, per kind of job (verify/__init__.py job_of).
SIGNED: dict[str, dict[str, tuple[str, ...]]] = {
    "watch": {
        "argv": ("probes", "watch", "argv"),
        "cwd": ("probes", "watch", "cwd"),
        "nproc": ("probes", "watch", "nproc"),
        "set": ("probes", "watch", "set"),
    },
    "job": {
        "spec": ("spec",),
        "world_size": ("job_run", "world_size"),
        "injections": ("job_run", "injections"),
        "backend": ("job_run", "backend"),
    },
}

# Environment variables a spec, a run or a recommendation may set for a job: the families that tune
# collectives (NCCL_*, TORCH_NCCL_*, GLOO_*), threads (OMP_*, MKL_*) and the CUDA allocator/runtime.
ENV_PREFIXES = ("NCCL_", "TORCH_", "GLOO_", "CUDA_", "OMP_", "MKL_", "PYTORCH_")
ENV_NAMES = frozenset({"CUBLAS_WORKSPACE_CONFIG", "NVIDIA_TF32_OVERRIDE", "TOKENIZERS_PARALLELISM"})
# Inside those families, names whose value chooses code to load: NCCL_NET_PLUGIN / NCCL_TUNER_PLUGIN /
# NCCL_PROFILER_PLUGIN dlopen a library the value names; TORCH_EXTENSIONS_DIR is where torch loads
# compiled extensions from.
ENV_CODE = frozenset({"TORCH_EXTENSIONS_DIR"})


class KeyRefused(OSError):
    """The signing key cannot be used: `why` says what is wrong with it (one short clause)."""

    def __init__(self, path: Path, why: str) -> None:
        super().__init__(why)
        self.path, self.why = path, why

    def __str__(self) -> str:
        return f"{self.path}: {self.why}"


# ---- the key -------------------------------------------------------------------------------------
def key_path() -> Path:
    """$XDG_CONFIG_HOME/ciuic-doctor/key, else ~/.config/ciuic-doctor/key (the XDG base-directory rule)."""
    base = os.environ.get("XDG_CONFIG_HOME") or ""
    if os.path.isabs(base):
        return Path(base) / "ciuic-doctor" / "key"
    try:
        home = Path.home()
    except RuntimeError:  # no $HOME and no passwd entry
        raise KeyRefused(Path("~/.config/ciuic-doctor/key"), "no home directory to keep it in") from None
    return home / ".config" / "ciuic-doctor" / "key"


def _check_owned(path: Path, info: os.stat_result, *, private: bool) -> None:
    if info.st_uid != os.geteuid():
        raise KeyRefused(path, f"owned by uid {info.st_uid}, not by you (uid {os.geteuid()})")
    loose = stat.S_IMODE(info.st_mode) & (0o077 if private else 0o022)
    if loose:
        raise KeyRefused(path, f"mode {stat.S_IMODE(info.st_mode):04o} lets others read or change it")


def load_key(*, create: bool = False) -> bytes:
    """This user's signing key; with `create`, made when missing (0600 file in a 0700 folder).

    Raises KeyRefused when it is missing (and not created), a symlink, not a regular file, owned by
    someone else, open to group or others, or malformed."""
    path = key_path()
    folder = path.parent
    if create:
        try:
            folder.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            os.mkdir(folder, 0o700)
        except FileExistsError:
            pass
        except OSError as exc:
            raise KeyRefused(folder, f"cannot be made ({exc.strerror})") from None
    try:
        info = os.lstat(folder)
    except OSError:
        raise KeyRefused(path, "no key yet (made by the first `watch` or `job`)") from None
    if not stat.S_ISDIR(info.st_mode):
        raise KeyRefused(folder, "is a symlink or not a folder")
    _check_owned(folder, info, private=False)
    if create:
        _create_key(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise KeyRefused(path, "no key yet (made by the first `watch` or `job`)") from None
    except OSError as exc:
        raise KeyRefused(
            path, "a symlink" if os.path.islink(path) else exc.strerror or "unreadable"
        ) from None
    with os.fdopen(fd, "rb") as fh:
        info = os.fstat(fh.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise KeyRefused(path, "not a regular file")
        _check_owned(path, info, private=True)
        text = fh.read(MAX_KEY_FILE_BYTES).strip()
    try:
        key = bytes.fromhex(text.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        key = b""
    if len(key) < KEY_BYTES:
        raise KeyRefused(path, f"not a key ({KEY_BYTES * 2} hex digits expected)")
    return key


def _create_key(path: Path) -> None:
    """Write a new key unless one is there (O_EXCL: two ranks racing make one key, never two)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o600)
    except FileExistsError:
        return
    except OSError as exc:
        raise KeyRefused(path, f"cannot be made ({exc.strerror})") from None
    with os.fdopen(fd, "w") as fh:
        fh.write(secrets.token_hex(KEY_BYTES) + "\n")


# ---- signing -------------------------------------------------------------------------------------
def canonical(values: Mapping[str, Any]) -> bytes:
    """The bytes signed: JSON with sorted keys, no spaces, ASCII only; the values as meta.json holds
    them (a JSON round trip: tuples are lists)."""
    plain = json.loads(json.dumps(values, default=str))
    return json.dumps(plain, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def mac(key: bytes, kind: str, values: Mapping[str, Any]) -> str:
    """HMAC-SHA256 over the kind and the canonical values, hex."""
    return hmac.new(key, kind.encode() + b"\n" + canonical(values), hashlib.sha256).hexdigest()


def recorded(meta: Mapping[str, Any], kind: str) -> dict[str, Any]:
    """The values at `SIGNED[kind]`'s paths in meta.json (a path that is absent is left out)."""
    out: dict[str, Any] = {}
    for name, path in SIGNED[kind].items():
        node: Any = meta
        for part in path:
            node = node.get(part) if isinstance(node, Mapping) else None
        if node is not None:
            out[name] = node
    return out


def signature(kind: str, values: Mapping[str, Any]) -> dict[str, str] | None:
    """meta.json's `signatures[kind]` for `values` (the fields this command itself wrote), making the key
    when it is missing; None and one line on stderr when the key cannot be used (the run is then
    re-run only after a yes)."""
    values = {k: v for k, v in values.items() if v is not None and k in SIGNED[kind]}
    try:
        key = load_key(create=True)
    except KeyRefused as exc:
        print(f"ciuic-doctor: the run is not signed ({exc}); `verify` will ask first", file=sys.stderr)
        return None
    return {"scheme": SCHEME, "mac": mac(key, kind, values)}


def check(meta: Mapping[str, Any], kind: str) -> str | None:
    """None when meta.json's re-runnable part for `kind` carries this user's signature; else why not."""
    sigs = meta.get("signatures")
    entry = sigs.get(kind) if isinstance(sigs, Mapping) else None
    if not isinstance(entry, Mapping) or not isinstance(entry.get("mac"), str):
        return "not signed by you (recorded by someone else, by an older ciuic-doctor, or planted)"
    if entry.get("scheme") != SCHEME:
        return f"signed with an unknown scheme {str(entry.get('scheme'))[:40]!r}"
    try:
        key = load_key()
    except KeyRefused as exc:
        return f"your signing key cannot be used ({exc})"
    if not hmac.compare_digest(entry["mac"], mac(key, kind, recorded(meta, kind))):
        return "its signature does not match (changed since you recorded it, or signed by someone else)"
    return None


def folder_problem(path: Path) -> str | None:
    """Why a run directory is not trusted as a whole (git's safe.directory rule), or None: owned by
    another user, or writable by group or others (anyone could have changed what is in it)."""
    try:
        info = os.stat(path)
    except OSError as exc:
        return f"cannot be read ({exc.strerror})"
    if info.st_uid != os.geteuid():
        return f"is owned by uid {info.st_uid}, not by you (uid {os.geteuid()})"
    if stat.S_IMODE(info.st_mode) & 0o022:
        return f"is writable by group or others (mode {stat.S_IMODE(info.st_mode):04o})"
    return None


# ---- environment ---------------------------------------------------------------------------------
def env_refusal(name: str) -> str | None:
    """Why `name` may not be set for a job from a spec, a run or a recommendation; None when it may."""
    if name in ENV_NAMES:
        return None
    if not name.startswith(ENV_PREFIXES):
        return (
            "not a training setting (only "
            + ", ".join(p + "*" for p in ENV_PREFIXES)
            + " and a few exact names)"
        )
    if "PLUGIN" in name:
        return "loads a library named by the value"
    if name in ENV_CODE:
        return "names a folder code is loaded from"
    return None


def allowed_env(
    env: Mapping[str, Any], *, where: str, say: Callable[[str], None] | None = None
) -> dict[str, str]:
    """`env` without the names `env_refusal` refuses; the refused ones said in one line through `say`
    (stderr when None), once per call."""
    kept = {str(k): str(v) for k, v in env.items() if env_refusal(str(k)) is None}
    refused = sorted(str(k) for k in env if env_refusal(str(k)) is not None)
    if refused:
        shown = ", ".join(ascii(name[:60])[1:-1] for name in refused[:6]) + (
            ", ..." if len(refused) > 6 else ""
        )
        line = (
            f"ciuic-doctor: {where}: not exported: {shown} (a job's environment takes only "
            f"{', '.join(p + '*' for p in ENV_PREFIXES)}; never PYTHONPATH, LD_*, PATH or a plugin)"
        )
        (say or (lambda text: print(text, file=sys.stderr)))(line)
    return kept
