"""A real two-node Slurm cluster on this machine, for tests: one slurmctld, `slurmd -N n1`, `slurmd -N n2`.

Debian's `slurm-wlm` (22.05) and `munge`, run as root from a private temp folder: its own slurm.conf
(clients find it through `SLURM_CONF`), its own munged on its own socket, free ports for every daemon. Two
test runs, or a system Slurm, never share anything with it. `stop_cluster` stops exactly the daemons
`start_cluster` started, by PID, and whatever ran under them.

Outside pytest: `python tests/slurm_cluster.py` starts one, prints the `export SLURM_CONF=...` line for
another shell, and stops it on Ctrl-C.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PARTITION = "p"
NODES = ("n1", "n2")
# An srun/sbatch started inside a Slurm job (a CI runner that is itself a Slurm job) reads these from its
# environment: SLURM_JOB_ID makes srun attach a step to *that* job on *that* cluster, SBATCH_*/SRUN_* set
# options. The test cluster's clients must see none of them, only our SLURM_CONF.
_INHERITED_PREFIXES = ("SLURM_", "SLURMD_", "SBATCH_", "SALLOC_", "SRUN_", "SQUEUE_", "SINFO_", "SCANCEL_")
_DAEMONS = ("munged", "slurmctld", "slurmd")
_CLIENTS = ("sinfo", "squeue", "srun", "sbatch", "salloc", "scancel", "scontrol")


class ClusterUnavailable(RuntimeError):
    """Slurm cannot run here (not installed, not root, a daemon failed); the message is one line."""

    def __init__(self, reason: str, root: Path | None = None) -> None:
        super().__init__(reason)
        self.root = root  # the cluster's temp folder, if it got one (removed by now): what processes_of needs
        self.port_taken = False  # a daemon could not bind its port


@dataclass
class SlurmCluster:
    """A started cluster: what tests need to run Slurm commands against it, and what stopping it needs."""

    root: Path
    conf: Path
    env: dict[str, str]
    partition: str = PARTITION
    nodes: tuple[str, ...] = NODES
    ctld_port: int = 0
    node_ports: dict[str, int] = field(default_factory=dict)
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    start_s: float = 0.0

    @property
    def export_line(self) -> str:
        """What another shell needs to use this cluster's client commands."""
        return f"export SLURM_CONF={self.conf}"

    def run(
        self,
        *argv: str,
        timeout: float = 60,
        cwd: Path | str | None = None,
        input: str | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run a client command (`srun`, `sbatch`, `salloc`, `squeue`...) against this cluster, to the end.

        Output is captured as text; the return code is left to the caller. Past `timeout` the command is
        killed and TimeoutExpired raised; a job it left behind is cancelled when the cluster stops.
        """
        return subprocess.run(
            list(argv),
            check=False,
            env=self.env,
            cwd=cwd,
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def popen(self, *argv: str, **kwargs: Any) -> subprocess.Popen[str]:
        """Start a client command in the background (a step that should still be running while you look)."""
        kwargs.setdefault("stdout", subprocess.PIPE)
        kwargs.setdefault("stderr", subprocess.PIPE)
        return subprocess.Popen(list(argv), env=self.env, text=True, **kwargs)

    def node_states(self) -> dict[str, str]:
        """{node: state} as `sinfo` reports it now ("idle", "alloc", "mix", "down*"...); {} if it cannot."""
        try:
            answer = self.run("sinfo", "-h", "-N", "-o", "%N %t", timeout=10)
        except subprocess.TimeoutExpired:
            return {}
        if answer.returncode != 0:
            return {}
        return dict(line.split(None, 1) for line in answer.stdout.splitlines() if " " in line.strip())

    def log_tail(self, daemons: list[str] | None = None, lines: int = 3) -> str:
        """The last lines of the daemons' logs (default: all), on one line: for a skip or failure message.

        A daemon's files are `<name>.out` (its stdout and stderr) and `<name>.log` (its log file).
        """
        return _log_tail(self.root, daemons, lines)


def free_ports(count: int) -> list[int]:
    """`count` distinct random TCP ports that nothing is bound to now, below the kernel's ephemeral range.

    Random and checked, not fixed, so that parallel runs and a system Slurm do not collide. Not the
    kernel's own pick (bind to port 0): that comes from the ephemeral range, which the kernel also hands
    to every outgoing connection (each sinfo, srun, slurmd message), so one of those could take the port
    before the daemon binds it. Below the range only another explicit bind can; start_cluster retries
    once if that happens anyway.
    """
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # Linux's default
    ports: list[int] = []
    for _ in range(1000):
        if len(ports) == count:
            return ports
        port = random.randrange(10000, low) if low > 11000 else 0
        with socket.socket() as s:
            try:
                # All addresses, as the daemons bind: a listener on any one address would stop them.
                s.bind(("", port))
            except OSError:
                continue
            port = s.getsockname()[1]
        if port not in ports:
            ports.append(port)
    raise OSError(f"found {len(ports)} free TCP ports of {count} in 1000 tries")


def _which(name: str) -> str | None:
    # The daemons live in /usr/sbin, which a non-login shell's PATH may lack.
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin:/usr/local/sbin")


def _tool(name: str) -> str:
    if (path := _which(name)) is None:
        raise ClusterUnavailable(f"{name} is not installed (scripts/ensure-test-tools.sh installs it)")
    return path


def missing_tools() -> list[str]:
    """The daemons and client commands this module needs that are not installed."""
    return [name for name in (*_DAEMONS, *_CLIENTS) if _which(name) is None]


def client_env(conf: Path, base: dict[str, str] | None = None) -> dict[str, str]:
    """`base` (default: this process's environment) without inherited Slurm settings, plus SLURM_CONF."""
    base = dict(os.environ if base is None else base)
    env = {k: v for k, v in base.items() if not k.startswith(_INHERITED_PREFIXES)}
    env["SLURM_CONF"] = str(conf)
    return env


def slurm_conf(root: Path, ctld_port: int, node_ports: dict[str, int]) -> str:
    """The slurm.conf text for a cluster living in `root`; each non-obvious line says why it is there."""
    nodes = "\n".join(
        # NodeHostname=localhost: both slurmd run here, and slurmctld and srun reach node n1 at its
        # NodeAddr, which defaults to NodeHostname (else to the name "n1", which does not resolve).
        # Port: each slurmd listens on its own port, the only thing that tells the two apart on one host.
        # CPUs=1: one task slot per node, so two tasks need both nodes and a step holds a whole node.
        f"NodeName={name} NodeHostname=localhost Port={port} CPUs=1 RealMemory=4000"
        for name, port in node_ports.items()
    )
    return f"""\
# Written by tests/slurm_cluster.py for one test session; removed when the cluster stops.
ClusterName=ciuictest
# slurmctld refuses to run on a host that is not SlurmctldHost; Slurm reads "localhost" there as this
# host's own short name (and clients still connect to the address "localhost").
SlurmctldHost=localhost
SlurmctldPort={ctld_port}
# slurmctld's user (slurmd always runs as root, to start tasks as their user). Root, like everything
# here and in CI; the default, but said, since Debian's packaged services use a "slurm" user.
SlurmUser=root
AuthType=auth/munge
# Our own munged's socket, not the system's /run/munge: another munged (or none) may be running there
# with another key. Used by both auth/munge and cred/munge (job step credentials).
AuthInfo=socket={root / "munge.sock"}
StateSaveLocation={root / "ctld"}
SlurmctldPidFile={root / "ctld.pid"}
SlurmctldLogFile={root / "slurmctld.log"}
# %n is the node name: two slurmd on one host must not share a spool folder (step sockets, credential
# state) or a pid file (the second would take the first one's).
SlurmdSpoolDir={root / "spool%n"}
SlurmdPidFile={root / "slurmd.%n.pid"}
SlurmdLogFile={root / "slurmd.%n.log"}
# Without config_overrides a node whose hardware differs from its NodeName line (RealMemory=4000 on a
# smaller CI machine) registers as INVAL and never becomes idle.
SlurmdParameters=config_overrides
# No cgroups: containers and CI machines often cannot delegate them. linuxproc tracks a step's
# processes by parentage, which is all the tests need.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
# Allocate CPUs, not whole nodes or memory: one task per CPU, and memory is not enforced.
SelectTypeParameters=CR_CPU
MpiDefault=none
# The default 30 s between SIGTERM and SIGKILL would make a cancelled step that ignores SIGTERM (and so
# the cluster's stop) last half a minute; 5 s still lets a task handle SIGTERM as on a real cluster.
KillWait=5
# sbatch --wait polls after 2 s, then every 8 s while 2 s < MinJobAge/2 (default 300): 5 keeps it at 2 s. A
# finished job stays visible to squeue/scontrol for at least those 5 s (there is no sacct here).
MinJobAge=5
# Slurm looks for /bin/mail at start and logs an error without one; no test sends mail.
MailProg=/bin/true
{nodes}
PartitionName={PARTITION} Nodes={",".join(node_ports)} Default=YES MaxTime=INFINITE State=UP
"""


def _make_root() -> Path:
    root = Path(tempfile.mkdtemp(prefix="ciuic-slurm-"))
    if len(str(root)) > 60:
        # Unix socket paths (munged's, slurmd's per-step sockets in the spool folder) are limited to 107
        # bytes; a long TMPDIR would break them with confusing errors, so use /tmp instead.
        root.rmdir()
        root = Path(tempfile.mkdtemp(prefix="ciuic-slurm-", dir="/tmp"))
    # munged refuses a socket in a folder that not everyone may traverse ("execute permissions for all
    # required"), and mkdtemp makes 0700 folders. Nothing in here is secret but the key, which is 0400.
    root.chmod(0o755)
    return root


def _write_munge_key(path: Path) -> None:
    """A random 1024-bit key, mode 0400, owned by root, which munged runs as here.

    munged refuses a key readable by anyone but its own user. Written directly rather than by
    mungekey/create-munge-key, whose name and options differ between munge versions.
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
    with os.fdopen(fd, "wb") as key:
        key.write(os.urandom(128))


def _log_tail(root: Path, daemons: list[str] | None = None, lines: int = 3) -> str:
    parts = []
    for log in sorted([*root.glob("*.log"), *root.glob("*.out")]):
        if daemons is not None and log.name.rsplit(".", 1)[0] not in daemons:
            continue
        with contextlib.suppress(OSError):
            tail = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
            if tail:
                parts.append(f"{log.name}: " + " / ".join(tail[-lines:]))
    return " | ".join(parts) or "(no daemon logs)"


def _spawn(cluster: SlurmCluster, name: str, argv: list[str]) -> None:
    """Start one daemon in the foreground as our child, its output in `<root>/<name>.out`.

    Foreground (-D / -F) so that the PID we hold is the daemon's own (no fork to chase through a pid
    file) and we reap it. A new session, so that a terminal's Ctrl-C reaches only us and we stop the
    daemons in order instead of them dying mid-job.
    """
    with (cluster.root / f"{name}.out").open("wb") as out:
        cluster.processes[name] = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=cluster.root,
            env=cluster.env,
            start_new_session=True,
        )


def _wait(what: str, check: Callable[[], bool], cluster: SlurmCluster, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        dead = [name for name, proc in cluster.processes.items() if proc.poll() is not None]
        if dead:
            codes = ", ".join(f"{n} exited {cluster.processes[n].returncode}" for n in dead)
            raise ClusterUnavailable(f"{codes} while waiting for {what}: {cluster.log_tail(dead)}")
        if time.monotonic() > deadline:
            raise ClusterUnavailable(f"no {what} after {timeout_s:.0f} s: {cluster.log_tail()}")
        time.sleep(0.1)


def start_cluster(timeout_s: float = 60, extra_conf: str = "") -> SlurmCluster:
    """Start munged, slurmctld and both slurmd; return once `sinfo` shows every node idle.

    `extra_conf`: lines appended to slurm.conf. Raises ClusterUnavailable (one line, with the daemons' log
    tails) if Slurm cannot run here; nothing it started is left running then. If a daemon's port was
    taken between choosing it and binding it, it tries once more with other ports.
    """
    try:
        return _start_once(timeout_s, extra_conf)
    except ClusterUnavailable as error:
        if not error.port_taken:
            raise
    return _start_once(timeout_s, extra_conf)


def _start_once(timeout_s: float, extra_conf: str) -> SlurmCluster:
    if os.name != "posix" or os.geteuid() != 0:
        raise ClusterUnavailable("the test Slurm cluster runs as root (slurmd starts tasks as their user)")
    if missing := missing_tools():
        raise ClusterUnavailable(
            f"Debian's slurm-wlm and munge are not installed (missing {', '.join(missing)}; "
            "scripts/ensure-test-tools.sh installs them as root)"
        )
    began = time.monotonic()
    root = _make_root()
    conf = root / "slurm.conf"
    cluster = SlurmCluster(root=root, conf=conf, env=client_env(conf))
    try:
        cluster.ctld_port, *node_ports = free_ports(1 + len(NODES))
        cluster.node_ports = dict(zip(NODES, node_ports, strict=True))
        (root / "ctld").mkdir()
        for name in NODES:
            # slurmd logs "Domain socket directory ...: No such file or directory" without it.
            (root / f"spool{name}").mkdir()
        conf.write_text(slurm_conf(root, cluster.ctld_port, cluster.node_ports) + extra_conf)
        _write_munge_key(root / "munge.key")

        socket_path = root / "munge.sock"
        _spawn(cluster, "munged", [
            _tool("munged"), "--foreground", f"--socket={socket_path}", f"--key-file={root / 'munge.key'}",
            f"--pid-file={root / 'munged.pid'}", f"--seed-file={root / 'munged.seed'}",
            f"--log-file={root / 'munged.log'}",
        ])  # fmt: skip
        _wait("munged socket", socket_path.exists, cluster, timeout_s=10)
        # slurmd retries registering until slurmctld answers, so both can start at once.
        _spawn(cluster, "slurmctld", [_tool("slurmctld"), "-D", "-f", str(conf)])
        for name in NODES:
            _spawn(cluster, f"slurmd.{name}", [_tool("slurmd"), "-D", "-f", str(conf), "-N", name])
        _wait(
            "idle nodes in sinfo",
            lambda: cluster.node_states() == dict.fromkeys(NODES, "idle"),
            cluster,
            timeout_s=max(1.0, timeout_s - (time.monotonic() - began)),
        )
    except BaseException as error:
        tail = cluster.log_tail()
        port_taken = "Address already in use" in cluster.log_tail(lines=100)
        stop_cluster(cluster)
        if isinstance(error, ClusterUnavailable):
            error.root, error.port_taken = root, port_taken
            raise
        if isinstance(error, (OSError, subprocess.SubprocessError)):
            raise ClusterUnavailable(f"{type(error).__name__}: {error}: {tail}", root) from error
        raise
    cluster.start_s = time.monotonic() - began
    return cluster


def _children_map() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                # The command name (field 2) may hold spaces and parentheses: split after the last ")".
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry.name))
    return children


def _refers_to(pid: int, root: str) -> bool:
    proc = Path(f"/proc/{pid}")
    with contextlib.suppress(OSError):
        if root in (proc / "cmdline").read_bytes().decode(errors="replace"):
            return True
    with contextlib.suppress(OSError):
        if os.readlink(proc / "cwd").startswith(root):
            return True
    with contextlib.suppress(OSError):
        for fd in (proc / "fd").iterdir():
            with contextlib.suppress(OSError):
                if os.readlink(fd).startswith(root):
                    return True
    return False


def processes_of(root: Path, name: str | None = None) -> list[int]:
    """Live processes of the cluster in `root`: those naming it or holding a file in it, and their children.

    That is its daemons (their command lines name the folder), each slurmstepd (it keeps its slurmd's log
    open) and the job's tasks under them. With `name`, only processes of that command name (and their
    children) are looked for at the top. The calling process and its ancestors are never included.
    """
    mine = {os.getpid()}
    with contextlib.suppress(OSError):
        pid = os.getpid()
        while pid > 1:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            mine.add(pid)
    prefix = str(root) + os.sep
    children = _children_map()
    found: set[int] = set()
    todo = [
        pid
        for pids in children.values()
        for pid in pids
        if pid not in mine and (name is None or _comm(pid) == name) and _refers_to(pid, prefix)
    ]
    while todo:
        pid = todo.pop()
        if pid not in found and pid not in mine:
            found.add(pid)
            todo.extend(children.get(pid, []))
    return sorted(pid for pid in found if not _is_zombie(pid))


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True  # gone


def _terminate(procs: list[subprocess.Popen[bytes]], timeout_s: float) -> None:
    """SIGTERM, then SIGKILL whatever is still running after `timeout_s`; reap all."""
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait()


def stop_cluster(cluster: SlurmCluster, timeout_s: float = 10) -> None:
    """Cancel the cluster's jobs, stop its daemons (SIGTERM, SIGKILL after `timeout_s`), remove its folder.

    Only what this cluster started is touched: the daemons by the PIDs we hold, and, should a job step
    outlive the cancel, the slurmstepd processes that hold this cluster's log open and their tasks.
    """
    ctld = cluster.processes.get("slurmctld")
    if ctld is not None and ctld.poll() is None:
        # Cancel through our own controller (SLURM_CONF in env), every job of our one partition.
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            cluster.run("scancel", f"--partition={cluster.partition}", timeout=10)
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                left = cluster.run("squeue", "-h", "-o", "%i", timeout=10)
                if left.returncode != 0 or not left.stdout.strip():
                    break
                time.sleep(0.1)
    slurm = [proc for name, proc in cluster.processes.items() if name != "munged"]
    _terminate(slurm, timeout_s)
    # Last: the slurm daemons authenticate through munged until they are gone.
    _terminate([proc for name, proc in cluster.processes.items() if name == "munged"], timeout_s)
    # A slurmstepd (and its tasks) outlives its slurmd by design; after the cancel there should be none.
    # Only those: a person's `tail -f` of our log also holds a file here, and it is not ours to kill.
    strays = processes_of(cluster.root, name="slurmstepd")
    for pid in strays:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    shutil.rmtree(cluster.root, ignore_errors=True)


def main() -> int:
    """Start a cluster, print how to use it, and stop it on Ctrl-C (or SIGTERM)."""
    try:
        cluster = start_cluster()
    except ClusterUnavailable as error:
        print(f"cannot start the test Slurm cluster: {error}", file=sys.stderr)
        return 1
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        nodes = ", ".join(cluster.nodes)
        print(f"two-node Slurm up in {cluster.start_s:.1f} s (partition {cluster.partition}, nodes {nodes};")
        print(f"logs in {cluster.root}). In another shell:")
        print(cluster.export_line, flush=True)
        print("Ctrl-C stops it.", file=sys.stderr, flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        # A second Ctrl-C (or SIGTERM) must not cut the stop short and leave daemons behind.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        began = time.monotonic()
        stop_cluster(cluster)
        print(f"stopped in {time.monotonic() - began:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
