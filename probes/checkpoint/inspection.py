"""What a checkpoint holds, and whether it can be read without running code: checkpoint-check's inspector.

Safety. A `torch.save` file is a pickle; `torch.load(weights_only=False)` runs whatever callables the
pickle names (`io.open`, `os.system`, ...). `weights_only=True` unpickles only tensors, plain containers
and an allowlist of globals, and refuses the rest with `Unsupported global: GLOBAL <name>`. A checkpoint
that needs more than that is an `unsafe_checkpoint` finding; it is never loaded with weights_only=False.
weights_only itself had bypasses before torch 2.6 (CVE-2025-32434, GHSA-53q9-r3pm-6pq6) and memory
corruption before 2.10 (CVE-2026-24747), so on an older torch an inspected file is not unpickled at
all: only its pickle opcodes are read (pickletools parses opcodes, it executes nothing).

Contents. `classify` walks the loaded object (dicts, lists; tensors are leaves) and recognises each kind
of state by its shape, whatever key it sits under: an optimizer state dict has `state` + `param_groups`,
an LR scheduler `last_epoch` + `base_lrs`, a GradScaler `scale` + `growth_factor`, Python's RNG state is
`(version, 625 ints, gauss)`, NumPy's MT19937 `keys` + `pos`, torch's CPU generator a uint8 tensor of
`torch.get_rng_state().numel()` bytes (5056 on torch 2.x); model weights are a dict of tensors. Sampler
position and step counters are recognised by name (epoch, start_index, consumed_samples, global_step...).
"""

from __future__ import annotations

import pickletools
import re
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Every kind of state a resumed run needs, in the order findings list them.
KINDS = (
    "model",
    "optimizer",
    "scheduler",
    "scaler",
    "rng.python",
    "rng.numpy",
    "rng.torch",
    "rng.cuda",
    "sampler",
    "step",
)
# Needed only by some jobs: the GradScaler with fp16, the CUDA generators on a GPU.
CONDITIONAL = {"scaler": "needed with fp16 + GradScaler", "rng.cuda": "needed on CUDA"}
SAMPLER_NAMES = {
    "sampler",
    "epoch",
    "start_index",
    "micro_batches",
    "data_position",
    "consumed_samples",
    "consumed_train_samples",
    "samples_seen",
}
STEP_NAMES = {"step", "global_step", "iteration", "iter", "steps_done"}
MODEL_NAMES = {"model", "state_dict", "model_state_dict", "module", "net", "weights", "ema"}
WEIGHTS_ONLY_TRUSTED_SINCE = (2, 10)  # CVE-2025-32434 fixed in 2.6, CVE-2026-24747 in 2.10
MAX_DEPTH = 6
MAX_ITEMS = 256  # list items walked per list (per-rank RNG lists, parameter lists)
MAX_PICKLE_SCAN_BYTES = 64 << 20
# Globals torch.save writes for tensors and plain containers besides torch.* (weights_only allows them).
PLAIN_GLOBALS = {
    "collections.OrderedDict",
    "_codecs.encode",
    "builtins.set",
    "builtins.frozenset",
    "builtins.bytearray",
    "builtins.slice",
    "builtins.complex",
}
_UNSUPPORTED = re.compile(r"Unsupported global: GLOBAL ([\w.]+)")


@dataclass(kw_only=True)
class Safety:
    """How `path` fared under the weights_only unpickler."""

    path: str
    size_bytes: int
    container: str  # torch-zip | torch-legacy | not-torch
    loaded: bool = False  # unpickled with weights_only=True
    safe: bool | None = None  # None: unknown (not a torch file, or not unpickled on an old torch)
    unsafe_globals: list[str] = field(default_factory=list)
    error: str | None = None
    pickle_names: list[str] = field(default_factory=list)  # dict keys seen in the pickle stream
    obj: Any = field(default=None, repr=False)


def torch_version() -> tuple[int, ...]:
    import torch

    return tuple(int(p) for p in re.findall(r"\d+", torch.__version__)[:2])


def _pickle_bytes(path: Path) -> bytes:
    """The pickle stream of a torch file: `<archive>/data.pkl` of the zip format, else the file itself."""
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as archive:
            name = next((n for n in archive.namelist() if n.endswith("/data.pkl") or n == "data.pkl"), None)
            if name is None:
                return b""
            with archive.open(name) as fh:
                return fh.read(MAX_PICKLE_SCAN_BYTES)
    with open(path, "rb") as fh:
        return fh.read(MAX_PICKLE_SCAN_BYTES)


def scan_pickle(data: bytes) -> tuple[list[str], list[str]]:
    """(globals named, strings pushed) by the pickle(s) in `data`, read as opcodes: nothing is executed.

    >>> import pickle, collections
    >>> scan_pickle(pickle.dumps({"optimizer": collections.OrderedDict()}))
    (['collections.OrderedDict'], ['optimizer'])
    """
    globals_: list[str] = []
    strings: list[str] = []
    offset = 0
    while offset < len(data):  # the legacy format is several pickles back to back
        recent: list[str] = []
        try:
            for op, arg, pos in pickletools.genops(data[offset:]):
                if op.name in ("GLOBAL", "INST"):
                    globals_.append(str(arg).replace(" ", "."))
                elif op.name == "STACK_GLOBAL" and len(recent) >= 2:
                    globals_.append(f"{recent[-2]}.{recent[-1]}")
                    del strings[-2:]  # the module and name it took are not data
                elif isinstance(arg, str) and ("UNICODE" in op.name or op.name.endswith("STRING")):
                    recent.append(str(arg))
                    strings.append(str(arg))
                if op.name == "STOP":
                    offset += pos + 1
                    break
            else:
                break
        except (ValueError, UnicodeDecodeError, EOFError):
            break  # the tensor bytes after the last pickle of a legacy file, or a non-pickle file
    return list(dict.fromkeys(globals_)), list(dict.fromkeys(strings))


def check_safety(path: Path, *, trusted: bool = False) -> Safety:
    """Unpickle `path` with weights_only=True, never anything more. A file from elsewhere (`trusted`
    False: --inspect) is not unpickled at all on a torch with known weights_only bypasses; a file this
    run just wrote is."""
    import pickle

    import torch

    container = "torch-zip" if zipfile.is_zipfile(path) else "torch-legacy"
    result = Safety(path=str(path), size_bytes=path.stat().st_size, container=container)
    globals_, strings = scan_pickle(_pickle_bytes(path))
    result.pickle_names = [s for s in strings if s.isidentifier()][:200]
    if container == "torch-zip":
        try:
            result.unsafe_globals = list(torch.serialization.get_unsafe_globals_in_checkpoint(str(path)))
        except Exception:  # torch < 2.5, or a zip that is not a torch archive
            result.unsafe_globals = []
    if not trusted and torch_version() < WEIGHTS_ONLY_TRUSTED_SINCE:
        result.error = (
            f"torch {torch.__version__} has known weights_only bypasses (fixed in 2.6 and 2.10): "
            "not unpickled; opcodes scanned only"
        )
        result.safe = False if result.unsafe_globals else None
        return result
    try:
        result.obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        text = str(exc)
        named = _UNSUPPORTED.findall(text)
        # Refused for a global it names, or for an opcode it does not take (a file that is not a
        # pickle, or a hand-made one): the globals in the opcodes tell which.
        unsafe = list(dict.fromkeys([*result.unsafe_globals, *named])) or suspicious(globals_)
        if not unsafe:
            result.container, result.error = "not-torch", _weights_only_reason(text)
            return result
        result.unsafe_globals = unsafe
        result.safe = False
        result.error = (
            f"weights_only=True refused it: unsupported global(s) {', '.join(result.unsafe_globals)}"
        )
        return result
    except Exception as exc:  # KeyError, RuntimeError, EOFError...: torch.load's words for "not mine"
        result.container, result.error = "not-torch", _one_line(f"{type(exc).__name__}: {exc}")
        return result
    result.loaded = True
    result.safe = True
    return result


def suspicious(globals_: list[str]) -> list[str]:
    """Globals a plain torch.save of tensors and containers never names.

    >>> suspicious(["torch._utils._rebuild_tensor_v2", "collections.OrderedDict", "posix.system"])
    ['posix.system']
    """
    return [g for g in globals_ if not g.startswith("torch.") and g not in PLAIN_GLOBALS]


def _weights_only_reason(text: str) -> str:
    """The WeightsUnpickler's own words ("Unsupported operand 34") rather than its advice paragraph."""
    found = re.search(r"WeightsUnpickler error:\s*(.+)", text)
    return found.group(1).strip()[:300] if found else _one_line(text)


def _one_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[0][:300] if lines else ""


# ---- contents --------------------------------------------------------------------------------------
def _is_tensor(value: Any) -> bool:
    return type(value).__name__ in ("Tensor", "Parameter") and hasattr(value, "dtype")


def _torch_rng_bytes() -> int:
    import torch

    return int(torch.get_rng_state().numel())


def _is_python_rng(value: Any) -> bool:
    """random.getstate(): (version, tuple of 625 ints, gauss_next)."""
    return (
        isinstance(value, list | tuple)
        and len(value) == 3
        and isinstance(value[0], int)
        and isinstance(value[1], list | tuple)
        and len(value[1]) == 625
    )


def _is_numpy_rng(value: Any) -> bool:
    """np.random.get_state() as a tuple ('MT19937', keys, pos, ...), or a dict of its parts."""
    if isinstance(value, dict):
        return "keys" in value and "pos" in value
    return isinstance(value, list | tuple) and len(value) >= 3 and value[0] == "MT19937"


def _is_rng_tensor(value: Any, numel: int | None = None) -> bool:
    return (
        _is_tensor(value) and str(value.dtype) == "torch.uint8" and (numel is None or value.numel() == numel)
    )


def _is_weights(value: dict) -> bool:
    """A model state dict: mostly tensors under dotted names."""
    if not value:
        return False
    tensors = sum(1 for v in value.values() if _is_tensor(v))
    return tensors >= max(1, int(0.8 * len(value))) and any("." in str(k) for k in value)


class _Walker:
    def __init__(self) -> None:
        self.found: dict[str, str] = {}
        self.empty: dict[str, str] = {}
        self.rng_bytes = _torch_rng_bytes()

    def note(self, kind: str, where: str) -> None:
        self.found.setdefault(kind, where or "<top>")

    def walk(self, value: Any, where: str, name: str, depth: int) -> None:
        if depth > MAX_DEPTH:
            return
        if self._leaf(value, where, name):
            return
        if isinstance(value, dict):
            for key, item in value.items():
                self.walk(item, f"{where}.{key}" if where else str(key), str(key).lower(), depth + 1)
        elif isinstance(value, list | tuple):
            for index, item in enumerate(value[:MAX_ITEMS]):
                self.walk(item, f"{where}[{index}]", name, depth + 1)

    def _leaf(self, value: Any, where: str, name: str) -> bool:
        """Recognise `value` as one kind of state; True when there is nothing more to walk inside it."""
        if isinstance(value, dict):
            keys = set(map(str, value))
            if {"state", "param_groups"} <= keys:
                self.note("optimizer", where)
            elif "last_epoch" in keys and ({"base_lrs", "_step_count"} & keys):
                self.note("scheduler", where)
            elif "scale" in keys and ({"growth_factor", "_growth_tracker"} & keys):
                self.note("scaler", where)
            elif "_num_yielded" in keys:  # torchdata's StatefulDataLoader.state_dict()
                self.note("sampler", where)
            elif not value and "scaler" in name:
                self.empty.setdefault("scaler", f"{where} is empty (GradScaler disabled when saved)")
            elif _is_numpy_rng(value):
                self.note("rng.numpy", where)
            elif _is_weights(value) or (
                name in MODEL_NAMES and value and all(map(_is_tensor, value.values()))
            ):
                self.note("model", where)
            else:
                if name in SAMPLER_NAMES:
                    self.note("sampler", where)
                return False
            return True
        if _is_python_rng(value):
            self.note("rng.python", where)
            return True
        if _is_numpy_rng(value):
            self.note("rng.numpy", where)
            return True
        if "cuda" in name and (
            _is_rng_tensor(value)
            or (isinstance(value, list | tuple) and value and all(_is_rng_tensor(v) for v in value))
        ):
            self.note("rng.cuda", where)
            return True
        if _is_rng_tensor(value, self.rng_bytes):
            self.note("rng.torch", where)
            return True
        if isinstance(value, int | float) and not isinstance(value, bool):
            if name in SAMPLER_NAMES:
                self.note("sampler", where)
            elif name in STEP_NAMES:
                self.note("step", where)
            return True
        return _is_tensor(value) or isinstance(value, str | bytes | bool) or value is None


def classify(obj: Any) -> tuple[dict[str, str], dict[str, str]]:
    """({kind: where it was found}, {kind: why it counts as absent although a key exists})."""
    walker = _Walker()
    if isinstance(obj, dict) and _is_weights(obj):
        walker.note("model", "")  # a bare model state_dict
    else:
        walker.walk(obj, "", "", 0)
    return walker.found, walker.empty


def kinds_from_names(names: list[str]) -> dict[str, str]:
    """Kinds guessed from the dict keys in a pickle that was not unpickled (an unsafe file)."""
    lowered = {n.lower() for n in names}
    guesses = {
        "model": MODEL_NAMES,
        "optimizer": {"optimizer", "optim", "optimizer_state_dict", "param_groups"},
        "scheduler": {"scheduler", "lr_scheduler", "last_epoch", "base_lrs"},
        "scaler": {"scaler", "grad_scaler", "growth_factor"},
        "rng.python": {"python", "random", "python_rng"},
        "rng.numpy": {"numpy", "np", "numpy_rng"},
        "rng.torch": {"torch", "cpu", "torch_rng", "cpu_rng_state"},
        "rng.cuda": {"cuda", "cuda_rng", "cuda_rng_state"},
        "sampler": SAMPLER_NAMES,
        "step": STEP_NAMES,
    }
    return {kind: "key name in the pickle (not loaded)" for kind, keys in guesses.items() if keys & lowered}


def absent(found: dict[str, str], *, applicable: set[str] | None = None) -> tuple[list[str], list[str]]:
    """(missing kinds, kinds absent but not needed). `applicable` None: unknown job, CONDITIONAL kinds are
    listed as not needed with their condition."""
    missing: list[str] = []
    not_needed: list[str] = []
    for kind in KINDS:
        if kind in found:
            continue
        needed = kind not in CONDITIONAL if applicable is None else kind in applicable
        (missing if needed else not_needed).append(kind)
    return missing, not_needed


def inspect_record(safety: Safety, *, role: str) -> dict[str, Any]:
    """The `kind: inspect` record for one file (the `obj` itself is not recorded)."""
    if safety.loaded:
        found, empty = classify(safety.obj)
        guessed = False
    else:
        found, empty, guessed = kinds_from_names(safety.pickle_names), {}, True
    missing, not_needed = absent(found)
    return {
        "kind": "inspect",
        "role": role,
        "path": safety.path,
        "size_bytes": safety.size_bytes,
        "container": safety.container,
        "weights_only_loaded": safety.loaded,
        "safe": safety.safe,
        "unsafe_globals": safety.unsafe_globals,
        "error": safety.error,
        "present": found,
        "empty": empty,
        "missing": missing,
        "conditional": {k: CONDITIONAL[k] for k in not_needed if k in CONDITIONAL},
        "guessed_from_names": guessed,
    }
