"""Reading a rank's stacks in a hang dump: the user's own frame, the main thread, and the collective a
stack waits in (Python's c10d frames, or C++ frames from `py-spy --native` for DDP's all_reduce inside
backward, which Python never shows).
"""

from __future__ import annotations

from typing import Any

_LIBRARY = (
    "/torch/", "/site-packages/", "/dist-packages/", "/ciuic_doctor/", "/probes/watch", "/lib/python3",
    "<frozen",
)  # fmt: skip
_LAUNCHERS = ("ciuic-doctor", "torchrun", "__main__.py")  # console scripts and `python -m`: never the culprit


def user_frame(frames: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The innermost frame in the user's code (frames are innermost first); never one of watch's own, nor
    a console script's (`bin/ciuic-doctor`, `bin/torchrun`: the frame that runs everything below it), nor
    a C/C++ frame."""
    for frame in frames:
        name = str(frame.get("file") or frame.get("filename") or "")
        if (
            not frame.get("native")
            and not any(part in name for part in _LIBRARY)
            and name.rsplit("/", 1)[-1] not in _LAUNCHERS
        ):
            return frame
    return None


def frame_text(frame: dict[str, Any] | None) -> str | None:
    if frame is None:
        return None
    function = frame.get("function") or frame.get("name")
    return f"{function} at {frame.get('file') or frame.get('filename')}:{frame.get('line')}"


def main_frames(threads: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    for thread in threads or []:
        if thread.get("main"):
            return thread.get("frames", [])
    return (threads or [{}])[0].get("frames", []) if threads else []


# C++ frames (py-spy --native) that wait for a collective: DDP's reducer waits for its gradient buckets'
# all_reduce at the end of backward; a process group's own wait. (substring of the function, its op)
_NATIVE_WAITS = (
    ("c10d::Reducer::", "all_reduce"), ("allreduce", "all_reduce"), ("allgather", "all_gather"),
    ("reduce_scatter", "reduce_scatter"), ("alltoall", "all_to_all"), ("broadcast", "broadcast"),
    ("barrier", "barrier"),
)  # fmt: skip


def collective_in(frames: list[dict[str, Any]]) -> str | None:
    """The c10d function a stack is inside (all_reduce, barrier, ...), or None; in C++ frames too
    (DDP's all_reduce inside backward is seen only there)."""
    for frame in frames:
        if str(frame.get("file", "")).endswith("distributed_c10d.py"):
            return str(frame.get("function"))
    for frame in frames:
        function = str(frame.get("function") or "")
        if frame.get("native") and (
            "c10d::" in function or "gloo::" in function or "nccl" in function.lower()
        ):
            lowered = function.lower()
            for part, op in _NATIVE_WAITS:
                if part.lower() in lowered:
                    return op
    return None
