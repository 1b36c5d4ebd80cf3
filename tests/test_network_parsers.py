"""The output parsers against hand-written fixtures in the formats recorded in research/workloads.md
(nccl-tests v2.19 and v2.13, NCCL_DEBUG=INFO network lines, DeepEP v1.2.1 and main through mpirun)."""

from __future__ import annotations

from pathlib import Path

import pytest

from a4ray.parsers import deepep_log as deepep
from a4ray.parsers import nccl_debug, nccl_tests
from a4ray.programs.collectives import bus_factor

FIXTURES = Path(__file__).parent / "fixtures"


def lines(name: str) -> list[str]:
    return (FIXTURES / name).read_text().splitlines()


def test_nccl_tests_2_19_with_nccl_info_interleaved():
    (run,) = nccl_tests.parse(lines("nccl_tests_2.19_all_reduce_gib.txt"))
    assert (run.binary, run.collective, run.version, run.concluded) == ("all_reduce_perf", "all_reduce", "2.19.6", True)
    assert (run.min_bytes, run.max_bytes) == (2**30, 8 * 2**30)
    assert len(run.devices) == 16 and run.devices[9].host == "a4-node-1" and run.devices[9].name == "NVIDIA B200"
    assert [r.size for r in run.rows] == [2**30 * k for k in (1, 2, 4, 8)]
    top = run.largest
    assert (top.out_of_place.time_us, top.out_of_place.algbw, top.out_of_place.busbw) == (45237.7, 189.89, 356.04)
    assert top.busbw == 356.16 and top.wrong == 0 and run.wrong == 0
    # busbw = algbw x 2(n-1)/n for all_reduce over 16 ranks
    assert top.out_of_place.busbw == pytest.approx(top.out_of_place.algbw * bus_factor("all_reduce", 16), abs=0.01)
    assert (run.out_of_bounds, run.avg_busbw) == (0, 347.9338)


def test_nccl_tests_2_13_unchecked_and_e_notation():
    (run,) = nccl_tests.parse(lines("nccl_tests_2.13_all_gather_socket.txt"), binary="all_gather_perf")
    assert run.collective == "all_gather" and run.version is None and not run.concluded
    assert [r.out_of_place.wrong for r in run.rows] == [None, None, None]
    assert run.largest.size == 4 * 2**30 and run.largest.out_of_place.time_us == 2.6e6
    top = run.largest.out_of_place
    assert top.busbw == pytest.approx(top.algbw * bus_factor("all_gather", 16), abs=0.01)


def test_several_runs_split_and_na_placements():
    text = lines("nccl_tests_2.19_all_reduce_gib.txt") + [
        "# Collective test starting: alltoall_perf",
        "# nThread 1 nGpus 1 minBytes 1048576 maxBytes 1048576 step: 2(factor) warmup iters: 1 iters: 1 agg iters: 1 validation: 1 graph: 0",
        "     1048576        262144     float    none      -1   2074.7    0.51    0.38       0       N/A     N/A     N/A     N/A",
        "# Collective test concluded: alltoall_perf",
    ]
    runs = nccl_tests.parse(text)
    assert [r.collective for r in runs] == ["all_reduce", "alltoall"]
    assert runs[1].rows[0].in_place is None and runs[1].largest.busbw == 0.38


def test_transport_gib_with_gpudirect():
    report = nccl_debug.parse(lines("nccl_tests_2.19_all_reduce_gib.txt"))
    assert report.network == "gIB" and report.networks == {"gIB": 16}
    assert report.net_channels == {"gIB": 16} and report.gdr_channels == 16
    assert report.local_channels == {"P2P": 16} and report.plugins == ["gIB v1.0.6"]
    for expect in ("gib", "rdma", "any"):
        assert nccl_debug.check(report, expect) is None
    assert "expected IB" in nccl_debug.check(report, "ib")


def test_transport_socket_fallback_fails_when_rdma_expected():
    report = nccl_debug.parse(lines("nccl_tests_2.13_all_gather_socket.txt"))
    assert report.network == "Socket" and report.gdr_channels == 0
    problem = nccl_debug.check(report, "gib")
    assert "NCCL used Socket, expected gIB" in problem and "fell back to TCP sockets" in problem
    assert "fell back" in nccl_debug.check(report, "rdma")
    assert nccl_debug.check(report, "socket") is None


def test_transport_unknown_without_info_lines():
    report = nccl_debug.parse(["# nThread 1 nGpus 1", "NCCL version 2.21.5+cuda12.4"])
    assert report.info_lines == 0 and report.describe() == "unknown (no NCCL INFO lines)"
    assert "cannot confirm" in nccl_debug.check(report, "rdma")
    assert nccl_debug.check(report, "any") is None


def test_deepep_v1_2_1_one_node():
    (node,) = deepep.parse((3, line) for line in lines("deepep_v1.2.1_node.txt"))
    assert node.node == 3 and (node.cases, node.passed) == (32, 32) and node.all_passed
    assert node.layout_ms == 0.093
    assert node.best["dispatch FP8"].rdma_gbps == 73.20 and node.best["dispatch FP8"].nvl_gbps == 238.84
    assert node.best["dispatch BF16"].rdma_chunk == 32 and node.best["combine"].nvl_chunk == 6
    assert node.best["combine"].rdma_gbps == 71.72


def test_deepep_main_through_mpirun_tags_name_the_node():
    nodes = deepep.parse((0, line) for line in lines("deepep_main_mpi_tagged.txt"))  # all arrived on node 0
    assert [n.node for n in nodes] == [0, 1]
    assert (nodes[0].cases, nodes[0].passed, nodes[0].all_passed) == (24, 24, True)
    assert (nodes[1].cases, nodes[1].passed, nodes[1].all_passed) == (24, 23, False)
    assert nodes[0].best["dispatch BF16"].rdma_gbps == 77.41 and nodes[0].best["combine"].nvl_gbps == 234.02
    assert nodes[1].best == {}
