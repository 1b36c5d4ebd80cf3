"""The output parsers against real outputs, captured on 2 x H200 (nvidia-h200-x2, 2026-11-28; benchmarks/README.md):
nccl-tests v2.17.6 built by a4ray (`*_2xh200.txt`: all_reduce and alltoall under mpirun, with NCCL_DEBUG=INFO),
DeepEP 8a07e7e built by a4ray (its intranode and low-latency tests through the gang).

What that machine cannot show stays on fixtures written from the formats of nccl-tests' own src/common.cu and
NCCL's INFO lines at those versions,
each said so: gIB's network lines (no NIC there: NCCL used P2P and named Socket), nccl-tests v2.13's older
format, DeepEP's internode test (2+ nodes of 8 GPUs) in v1.2.1's format and through mpirun's tags."""

from __future__ import annotations

from pathlib import Path

import pytest

from a4ray.parsers import deepep_log as deepep
from a4ray.parsers import nccl_debug, nccl_tests
from a4ray.programs.collectives import bus_factor

FIXTURES = Path(__file__).parent / "fixtures"


def lines(name: str) -> list[str]:
    return (FIXTURES / name).read_text().splitlines()


def test_nccl_tests_2_17_6_real_all_reduce_with_nccl_info_interleaved():
    (run,) = nccl_tests.parse(lines("nccl_tests_2.17.6_all_reduce_2xh200.txt"))
    assert (run.binary, run.collective, run.version, run.concluded) == ("all_reduce_perf", "all_reduce", "2.17.6", True)
    assert (run.min_bytes, run.max_bytes) == (2**30, 8 * 2**30)
    assert [(d.rank, d.device, d.bus, d.name) for d in run.devices] == [
        (0, 0, "[0000:00:06]", "NVIDIA H200"), (1, 1, "[0000:00:07]", "NVIDIA H200")]
    assert [r.size for r in run.rows] == [2**30 * k for k in (1, 2, 4, 8)]
    top = run.largest
    assert (top.out_of_place.time_us, top.out_of_place.algbw, top.out_of_place.busbw) == (24916.0, 344.76, 344.76)
    assert top.busbw == 344.76 and top.wrong == 0 and run.check_problem() is None
    # busbw = algbw x 2(n-1)/n for all_reduce: 1 over 2 ranks
    assert top.in_place.busbw == pytest.approx(top.in_place.algbw * bus_factor("all_reduce", 2), abs=0.01)
    assert (run.out_of_bounds, run.avg_busbw) == (0, 335.448)


def test_nccl_tests_2_17_6_real_alltoall_in_place_unchecked():
    (run,) = nccl_tests.parse(lines("nccl_tests_2.17.6_alltoall_2xh200.txt"))
    assert run.collective == "alltoall" and [r.redop for r in run.rows] == ["none"] * 4
    top = run.largest
    assert top.out_of_place.wrong == 0 and top.in_place.wrong is None  # nccl-tests prints N/A: not checked in place
    assert (top.out_of_place.busbw, top.in_place.busbw, top.busbw) == (337.62, 364.72, 364.72)
    assert top.out_of_place.busbw == pytest.approx(top.out_of_place.algbw * bus_factor("alltoall", 2), abs=0.01)


def test_transport_on_one_host_is_p2p_and_names_socket():
    """Both ranks on one machine without a NIC: NCCL picks Socket as its network and every channel is P2P."""
    report = nccl_debug.parse(lines("nccl_tests_2.17.6_all_reduce_2xh200.txt"))
    assert report.networks == {"Socket": 2} and report.net_channels == {} and report.local_channels == {"P2P": 48}
    assert report.describe().startswith("NCCL network Socket; no inter-node channels (all peers on one host)")
    assert nccl_debug.check(report, "any") is None


def test_nccl_tests_2_19_with_gib_lines_written_from_the_format():
    """Written from nccl-tests 2.19's output format (it adds the nccl-headers/library words; gIB's lines need A4)."""
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
    text = lines("nccl_tests_2.17.6_all_reduce_2xh200.txt") + [
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


def test_deepep_real_intranode_on_one_node():
    (node,) = deepep.parse((0, line) for line in lines("deepep_8a07e7e_intranode_2xh200.txt"))
    assert (node.cases, node.passed, node.all_passed, node.layout_ms) == (24, 24, True, 0.034)
    assert node.best["dispatch BF16"] == deepep.Best(sms=24, nvl_chunk=12, nvl_gbps=339.25)
    assert node.best["dispatch FP8"].nvl_gbps == 246.99 and node.best["combine"].nvl_chunk == 7
    assert node.figures() == {"dispatch FP8 NVL": 246.99, "dispatch BF16 NVL": 339.25, "combine NVL": 287.24}
    assert node.errors == []


def test_deepep_real_low_latency_every_rank_at_the_slowest():
    (node,) = deepep.parse((0, line) for line in lines("deepep_8a07e7e_low_latency_2xh200.txt"))
    assert sorted(node.low_latency) == [0, 1] and node.cases == 0
    assert node.low_latency[1] == deepep.LowLatency(dispatch_combine_gbps=307.16, dispatch_gbps=263.25,
                                                    combine_gbps=360.66)
    assert node.figures() == {"dispatch": 255.83, "combine": 360.66, "dispatch+combine": 307.16}
    assert node.errors == []  # NVSHMEM's "init failed for transport: IBGDA" (no NIC) is no failure: it used NVLink


def test_deepep_failures_kept_in_their_own_words():
    """DeepEP's kernel timeout and host check, as csrc/kernels/intranode.cu L447 and exception.cuh L18 (8a07e7e)
    print them, and Python's end of the spawned process: each kept as printed, tagged lines split by node."""
    text = [
        "[1,0]<stdout>:DeepEP timeout for dispatch receivers, rank 1, responsible_channel = 3, tokens remained: 17",
        "[1,1]<stderr>:RuntimeError: Failed: CUDA error /DeepEP/csrc/deep_ep.cpp:97 'unspecified launch failure'",
        "[1,1]<stderr>:torch.multiprocessing.spawn.ProcessRaisedException: ",
    ]
    nodes = deepep.parse((0, line) for line in text)
    assert nodes[0].errors == ["DeepEP timeout for dispatch receivers, rank 1, responsible_channel = 3, tokens "
                               "remained: 17"]
    assert nodes[1].errors[0].startswith("RuntimeError: Failed: CUDA error") and len(nodes[1].errors) == 2
