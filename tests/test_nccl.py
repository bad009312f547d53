"""NCCL facts as pure functions, tested on recorded NCCL debug text (no GPU needed)."""

from __future__ import annotations

import doctest
from pathlib import Path

import pytest

from ciuic_doctor.machine import nccl

DATA = Path(__file__).parent / "data"
LOG = DATA / "nccl_debug_tuning.log"


def test_docstring_examples():
    result = doctest.testmod(nccl)
    assert result.attempted > 0
    assert result.failed == 0


@pytest.mark.parametrize(
    ("collective", "n", "factor"),
    [("all_reduce", 2, 1.0), ("all_reduce", 16, 1.875), ("all_gather", 8, 0.875), ("reduce_scatter", 4, 0.75),
     ("all_to_all", 2, 0.5), ("broadcast", 8, 1.0), ("all_reduce", 1, 0.0), ("broadcast", 1, 1.0)],
)  # fmt: skip
def test_busbw_factors_are_nccl_tests(collective, n, factor):
    assert nccl.busbw_factor(collective, n) == pytest.approx(factor)


@pytest.mark.parametrize(
    ("version", "algo", "value"),
    [((2, 21, 5), "tree", "Tree"), ((2, 23, 4), "ring", "Ring"), ((2, 24, 3), "tree", "allreduce:tree"),
     ((2, 27, 3), "ring", "allreduce:ring"), ((2, 26, 2), "nvls_tree", "allreduce:nvlstree"),
     (None, "tree", "Tree")],
)  # fmt: skip
def test_nccl_algo_env_form_follows_the_version(version, algo, value):
    """Per-collective syntax from 2.24.3 on (a global Tree would break broadcast there); plain before."""
    assert nccl.nccl_algo_env(algo, version) == value


def test_parse_version_forms():
    assert nccl.parse_version("2.26.2+cuda12.8") == (2, 26, 2)
    assert nccl.parse_version((2, 19)) == (2, 19, 0)
    assert nccl.parse_version(22304) == (2, 23, 4)
    assert nccl.parse_version("unknown") is None
    assert nccl.tuning_log_supported((2, 23, 4))
    assert not nccl.tuning_log_supported((2, 23, 3))
    assert not nccl.tuning_log_supported(None)


def test_tuning_lines_parsed_from_a_recorded_log():
    entries = nccl.parse_tuning_log(LOG.read_text())
    assert len(entries) == 15  # init, channel, version and WARN lines are not tuning lines
    first = entries[0]
    assert (first.func, first.bytes, first.algo, first.proto) == ("AllReduce", 4, "tree", "ll")
    with_comm = [e for e in entries if e.comm]
    assert {e.comm for e in with_comm} == {"0x55d1c2a3e4f0"}
    assert with_comm[0].channel_hi == 31
    assert {e.algo for e in entries} >= {"tree", "ring", "pat", "nvls_tree", "collnet_direct"}


def test_algo_used_per_size_ignores_other_sizes_and_takes_the_majority():
    entries = nccl.parse_tuning_log(LOG.read_text())
    assert nccl.algo_used(entries, "all_reduce", 1024, 16) == ("tree", "ll")
    assert nccl.algo_used(entries, "all_reduce", 26214400, 16) == ("tree", "simple")
    assert nccl.algo_used(entries, "all_reduce", 64 << 20, 16) == ("nvls_tree", "simple")
    # AllGather / ReduceScatter log one rank's share: 2 MiB total over 16 ranks = 128 KiB
    assert nccl.algo_used(entries, "all_gather", 2 << 20, 16) == ("ring", "ll128")
    assert nccl.algo_used(entries, "reduce_scatter", 2 << 20, 16) == ("pat", "simple")
    assert nccl.algo_used(entries, "broadcast", 2 << 20, 16) == ("ring", "simple")
    assert nccl.algo_used(entries, "all_reduce", 4096, 16) is None


def test_tuning_tail_reads_only_new_complete_lines(tmp_path):
    path = tmp_path / "nccl.log"
    tail = nccl.TuningTail(path)
    assert tail.read_new() == []  # NCCL has not opened the file yet
    lines = LOG.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:6]) + lines[6][:30])  # a line still being written
    assert [e.bytes for e in tail.read_new()] == [4, 1024]
    with open(path, "a") as fh:
        fh.write(lines[6][30:] + lines[7])
    assert [e.bytes for e in tail.read_new()] == [1024, 1024]
    assert tail.read_new() == []


def test_debug_file_path_expands_host_and_pid():
    assert nccl.debug_file_path("/tmp/nccl.%h.%p.log", "node3", 77) == "/tmp/nccl.node3.77.log"
    assert nccl.debug_file_path("/x/100%%-%q", "h", 1) == "/x/100%-%q"


@pytest.mark.parametrize(
    ("current", "updates"),
    [
        ({}, {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "TUNING", "NCCL_DEBUG_FILE": "/r/nccl.log"}),
        ({"NCCL_DEBUG": "WARN", "NCCL_DEBUG_SUBSYS": "INIT,NET"},
         {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET,TUNING", "NCCL_DEBUG_FILE": "/r/nccl.log"}),
        ({"NCCL_DEBUG": "TRACE", "NCCL_DEBUG_SUBSYS": "ALL", "NCCL_DEBUG_FILE": "/mine.%p"}, {}),
        ({"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "^INIT,TUNING", "NCCL_DEBUG_FILE": "/mine"},
         {"NCCL_DEBUG_SUBSYS": "^INIT"}),
    ],
)  # fmt: skip
def test_tuning_debug_env_keeps_what_the_user_set(current, updates):
    assert nccl.tuning_debug_env(current, "/r/nccl.log") == updates
