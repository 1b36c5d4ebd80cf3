"""`python -m a4ray.nccl_test` on the local cluster of simulated nodes: the CPU rehearsal (the torch
benchmark over gloo under torchrun), the nccl-tests path (real mpirun through Ray; the CUDA-only binary
replaced by an MPI stand-in with the same flags and output), a missing nccl-tests, and bad-node
isolation with one really misconfigured node."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from a4ray import nccl_test
from a4ray.builds import builder, toolchain, tools
from a4ray.builds.builder import BuildFailed
from a4ray.core.errors import ToolMissing
from a4ray.driver.execute import run
from a4ray.parsers import nccl_tests
from a4ray.programs.collectives import bus_factor
from a4ray.spec.toolbuilds import BuildSpec
from a4ray.workloads import tool_words
from conftest import job, scrape_until

STANDIN = Path(__file__).parent / "programs" / "nccl_tests_standin.py"


def test_cli_rehearsal_over_gloo_reports_every_collective(local_cluster, tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = nccl_test.main(["--local-nodes", "2", "--gpus-per-node", "2", "--result", str(out),
                         "--set", f"storage.local_workspace={tmp_path}", "--set", "nccl.cpu_max_bytes=4M",
                         "--set", "nccl.iters=2", "--set", "nccl.warmup=1"])
    printed = capsys.readouterr().out
    assert rc == 0, printed[-3000:]
    result = json.loads(out.read_text())
    assert (result["ok"], result["implementation"], result["backend"]) == (True, "torch", "gloo")
    assert not result["thresholds_applied"] and "simulated nodes" in result["thresholds_note"]
    names = [c["collective"] for c in result["collectives"]]
    assert names == ["all_reduce", "all_gather", "reduce_scatter", "alltoall"]
    for c in result["collectives"]:
        rows = c["run"]["rows"]
        assert [r["size"] for r in rows] == [2**20, 2**21, 2**22]
        assert c["largest_bytes"] == 2**22 and c["busbw"] > 0 and c["ok"]
        assert len(c["run"]["devices"]) == 4
        for row in rows:
            for placement in ("out_of_place", "in_place"):
                t = row[placement]
                if t is not None:  # nccl-tests' formulas, over 4 ranks
                    assert t["wrong"] == 0
                    assert t["busbw"] == pytest.approx(t["algbw"] * bus_factor(c["collective"], 4), abs=0.011)
                    assert t["algbw"] == pytest.approx(row["size"] / t["time_us"] / 1e3, rel=0.01, abs=0.011)
    assert "busbw at the largest size (GB/s)" in printed and re.search(r"PASS: busbw GB/s at the largest", printed)
    # Each collective's busbw, for the dashboard's Fabric bandwidth panel (Ray's metrics, as Prometheus reads them)
    run_id = Path(result["gang"]["log_dir"]).parent.name
    gauges = scrape_until(rf'^ray_a4ray_fabric_gbps\{{.*run="{run_id}"', lambda lines: len(lines) == len(names))
    scraped = {re.search(r'test="(\w+)"', g).group(1): float(g.split()[-1]) for g in gauges}
    assert scraped == pytest.approx({c["collective"]: c["busbw"] for c in result["collectives"]}, rel=1e-6), gauges
    assert all('figure="busbw"' in g and 'nodes="0,1"' in g for g in gauges), gauges


def _standin_binaries(tmp_path: Path) -> Path:
    bindir = tmp_path / "nccl-tests" / "build"
    bindir.mkdir(parents=True)
    binary = bindir / "all_reduce_perf"
    binary.write_text(f"#!{sys.executable}\nimport runpy\nrunpy.run_path({str(STANDIN)!r}, run_name='__main__')\n")
    binary.chmod(0o755)
    return bindir


def test_nccl_tests_path_runs_through_mpirun_on_every_gpu(local_cluster, tmp_path):
    spec = job("nccl_test", "cluster.nodes=3", "cluster.gpus_per_node=2",
               f"nccl.binaries_dir={_standin_binaries(tmp_path)}", "nccl.collectives=[all_reduce]",
               "nccl.min_bytes=64K", "nccl.max_bytes=1M", "nccl.factor=4", "nccl.iters=3", "nccl.warmup=1",
               workspace=tmp_path)
    result = run(spec)
    assert result.ok, result.verdict
    assert result.implementation == "nccl-tests"
    (c,) = result.collectives
    assert len(c.run.devices) == 6 and [r.size for r in c.run.rows] == [2**16, 2**18, 2**20]
    assert c.run.wrong == 0 and c.busbw > 0
    assert [n.status for n in result.gang.nodes] == ["succeeded", "standby", "standby"]
    logs = Path(result.gang.log_dir)
    assert "all_reduce_perf -b 64K -e 1M -f 4 -n 3 -w 1 -c 1 -d float -g 1" in (logs / "node-00.log").read_text()
    for rank in (1, 2):
        assert "orted" in (logs / f"node-{rank:02d}.log").read_text()


def test_missing_nccl_tests_names_the_nodes(local_cluster, tmp_path):
    spec = job("nccl_test", "cluster.nodes=2", "cluster.gpus_per_node=2", "nccl.implementation=nccl-tests",
               "nccl.binaries_dir=/nonexistent/nccl-tests/build", "nccl.collectives=[all_gather]", workspace=tmp_path)
    with pytest.raises(ToolMissing) as missing:
        run(spec)
    text = str(missing.value)
    assert "node 0" in text and "node 1" in text and "/nonexistent/nccl-tests/build/all_gather_perf" in text
    assert "nccl.implementation=auto" in text


@pytest.mark.slow
def test_isolation_names_the_misconfigured_node(extra_nodes, tmp_path):
    """Node 2's gloo is pointed at a NIC it does not have (as a node with a broken network setup would
    be): the all-node run fails, node pairs are tested, and node 2 is named."""
    nodes = extra_nodes(3, 1, node_env={2: {"GLOO_SOCKET_IFNAME": "a4ray-no-such-nic"}})
    spec = job("nccl_test", "cluster.nodes=3", "cluster.gpus_per_node=1", "cluster.stop_grace_s=3",
               "nccl.collectives=[all_reduce]", "nccl.cpu_min_bytes=1M", "nccl.cpu_max_bytes=1M", "nccl.iters=2",
               "nccl.warmup=1", "nccl.isolate=true", "timeout_s=120", *nodes.sets, workspace=tmp_path)
    result = run(spec)
    assert not result.ok
    iso = result.isolation
    assert [(b.rank, b.ip) for b in iso.bad_nodes] == [(2, nodes.ip(2))], iso
    assert [(t.nodes, t.ok) for t in iso.tests] == [([0, 1], True), ([0, 2], False)]
    assert "bad node(s): node 2" in result.verdict
    assert (Path(result.gang.log_dir) / "isolate" / "n0-n2" / "node-01.log").is_file()


# ------------------------------------------------------------------------------------------ the build step
# This machine has no GPU (and CI no CUDA), so the builds below use a STAND-IN COMPILER: a `nvcc` script that
# says its CUDA release and writes each `-o` target as the MPI stand-in binary above; and a stand-in source, a
# git repo whose Makefile takes nccl-tests' make variables (MPI=1 MPI_HOME CUDA_HOME NCCL_HOME NVCC_GENCODE),
# checks that what they point at is there, and calls $(CUDA_HOME)/bin/nvcc per binary. What is real: the
# toolchain probe, the staging of the pinned git source, the Ray build tasks, the lock, the cache and the MPI
# launch of what was built. The real nccl-tests and DeepEP builds ran on the GPU machine (benchmarks/README.md).

_MAKEFILE = """\
BINARIES = all_reduce all_gather reduce_scatter alltoall
build:
\ttest "$(MPI)" = 1 && test -f $(MPI_HOME)/include/mpi.h && test -f $(NCCL_HOME)/include/nccl.h
\ttest -e $(NCCL_HOME)/lib/libnccl.so && test -n "$(NVCC_GENCODE)"
\tmkdir -p build && for b in $(BINARIES); do \\
\t  $(CUDA_HOME)/bin/nvcc $(NVCC_GENCODE) -o build/$${b}_perf src/$$b.cu || exit 1; done
"""


def standin_toolchain(root: Path) -> list[str]:
    """A CUDA home with the stand-in nvcc and CCCL's header, NCCL's header and library, MPI's header: the
    `nccl.build.*` overrides that point at them."""
    cuda = root / "cuda"
    (cuda / "bin").mkdir(parents=True)
    (cuda / "include" / "cccl" / "cuda" / "std").mkdir(parents=True)
    (cuda / "include" / "cccl" / "cuda" / "std" / "tuple").write_text("")
    nvcc = cuda / "bin" / "nvcc"
    nvcc.write_text(
        "#!/bin/sh\n# stand-in nvcc: no CUDA on this machine\n"
        'case " $* " in *" --version "*) echo "Cuda compilation tools, release 13.0, V13.0.88"; exit 0;; esac\n'
        'out=""; prev=""; for a in "$@"; do [ "$prev" = "-o" ] && out="$a"; prev="$a"; done\n'
        f"printf '#!{sys.executable}\\nimport runpy\\nrunpy.run_path(\"{STANDIN}\", run_name=\"__main__\")\\n' "
        '> "$out" && chmod +x "$out"\n')
    nvcc.chmod(0o755)
    nccl = root / "nccl"
    (nccl / "include").mkdir(parents=True)
    (nccl / "lib").mkdir()
    (nccl / "include" / "nccl.h").write_text("#define NCCL_MAJOR 2\n#define NCCL_MINOR 28\n#define NCCL_PATCH 9\n")
    (nccl / "lib" / "libnccl.so.2").write_text("")
    mpi = root / "mpi"
    (mpi / "include").mkdir(parents=True)
    (mpi / "include" / "mpi.h").write_text("#define OMPI_MAJOR_VERSION 4\n#define OMPI_MINOR_VERSION 1\n"
                                           "#define OMPI_RELEASE_VERSION 6\n")
    return [f"nccl.build.cuda_home={cuda}", f"nccl.build.nccl_home={nccl}", f"nccl.build.mpi_home={mpi}",
            "nccl.build.gpu_arch=9.0"]


def standin_source(root: Path) -> str:
    """A git repo with the stand-in Makefile, pinned by its commit: `git+file://...@<commit>`."""
    repo = root / "nccl-tests-standin"
    (repo / "src").mkdir(parents=True)
    (repo / "Makefile").write_text(_MAKEFILE)
    for b in ("all_reduce", "all_gather", "reduce_scatter", "alltoall"):
        (repo / "src" / f"{b}.cu").write_text(f"// {b}\n")
    git = ["git", "-c", "user.name=a4ray", "-c", "user.email=a4ray@localhost"]
    for argv in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "stand-in"]):
        subprocess.run([*git, *argv], cwd=repo, check=True)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True).stdout.strip()
    return f"git+file://{repo}@{commit}"


def test_build_step_names_each_missing_piece(tmp_path, monkeypatch):
    """The probe's line for each piece a build needs and a node lacks, with where it looked."""
    monkeypatch.setattr(toolchain.ctypes.util, "find_library", lambda name: None)
    empty = tmp_path / "empty"
    (empty / "bin").mkdir(parents=True)
    tc = toolchain.probe(BuildSpec(cuda_home=str(empty), nccl_home=str(empty), nvshmem_dir=str(empty),
                                   mpi_home=str(empty), gpu_arch="9.0"))
    missing = tc.missing(toolchain.PIECES)
    assert any(m.startswith(f"nvcc: not found at {empty}/bin/nvcc") for m in missing), missing
    assert any(m.startswith("the NCCL headers: no include/nccl.h") and str(empty) in m for m in missing)
    assert any(m.startswith("NVSHMEM: no include/ and lib/libnvshmem_host.so*") for m in missing)
    assert any(m.startswith("libibverbs: not found") for m in missing)
    assert any(m.startswith(f"MPI: no include/mpi.h in {empty}") for m in missing)
    # nvcc present but CUDA 13's CCCL headers not: DeepEP's `cuda/std/tuple: No such file` said before the build.
    standin_toolchain(tmp_path / "tc")
    cuda = tmp_path / "tc" / "cuda"
    shutil.rmtree(cuda / "include" / "cccl")
    tc = toolchain.probe(BuildSpec(cuda_home=str(cuda), gpu_arch="9.0"))
    assert tc.cuda_version == "13.0" and "nvcc" not in tc.problems
    assert tc.problems["cccl"].startswith(f"the CCCL headers: cuda/std/tuple is in neither {cuda}/include/cccl")


def test_build_cache_key_follows_every_version(tmp_path):
    standin_toolchain(tmp_path)
    spec = BuildSpec(cuda_home=str(tmp_path / "cuda"), nccl_home=str(tmp_path / "nccl"),
                     mpi_home=str(tmp_path / "mpi"), gpu_arch="9.0")
    tc = toolchain.probe(spec)
    assert (tc.cuda_version, tc.nccl_version, tc.mpi_version, tc.gencode) == (
        "13.0", "2.28.9", "OpenMPI 4.1.6", "-gencode=arch=compute_90,code=sm_90")
    recipe = tools.NCCL_TESTS
    key = builder.cache_key(recipe.key_facts(tc, "a" * 40))
    assert key == builder.cache_key(recipe.key_facts(toolchain.probe(spec), "a" * 40))  # same node, same key
    for change in ({"cuda_version": "12.9"}, {"nccl_version": "2.27.7"}, {"gpu_arch": "10.0"},
                   {"mpi_version": "OpenMPI 5.0.3"}):
        assert builder.cache_key(recipe.key_facts(tc.model_copy(update=change), "a" * 40)) != key, change
    assert builder.cache_key(recipe.key_facts(tc, "b" * 40)) != key


def test_build_is_cached_by_key_and_rebuilt_when_damaged(tmp_path):
    """The build task's body on this node: built once, then a cache hit by its key; a build directory
    whose outputs changed is set aside and built again, never trusted."""
    sets = standin_toolchain(tmp_path / "tc")
    source = standin_source(tmp_path)
    spec = BuildSpec(source=source, **{s.split("=")[0].rpartition(".")[2]: s.split("=", 1)[1] for s in sets})
    req = builder.BuildRequest(tool="nccl-tests", spec=spec, node=0, workspace=str(tmp_path / "ws"),
                               source_dir=str(tmp_path / "nccl-tests-standin"), run_log=str(tmp_path / "run.log"))
    first = builder.build_here(req)
    assert first.status == "built" and Path(first.path).name == first.key[:12]
    record = json.loads((Path(first.path) / builder.RECORD).read_text())
    assert record["facts"]["commit"] == source.rpartition("@")[2] and record["facts"]["nccl"] == "2.28.9"
    assert set(record["outputs"]) == {f"src/build/{c}_perf" for c in ("all_reduce", "all_gather", "reduce_scatter",
                                                                       "alltoall")}
    assert "$ make -j16 MPI=1" in (tmp_path / "run.log").read_text()
    again = builder.build_here(req)
    assert (again.status, again.path) == ("cached", first.path)
    assert "cached" in (tmp_path / "run.log").read_text()
    (Path(first.path) / "src" / "build" / "alltoall_perf").write_text("changed")
    rebuilt = builder.build_here(req)
    assert (rebuilt.status, rebuilt.path) == ("built", first.path)
    assert len(list((tmp_path / "ws" / "builds" / "nccl-tests").glob(".damaged-*"))) == 1
    # A build that fails says so in the compiler's words, with the whole log in the run's logs.
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "Makefile").write_text('build:\n\t@echo "src/all_reduce.cu(12): error: identifier nccl_x is undefined"'
                                     ' && exit 2\n')
    failing = req.model_copy(update={"source_dir": str(broken), "spec": spec.model_copy(update={"gpu_arch": "10.0"})})
    with pytest.raises(BuildFailed, match=r"building nccl-tests on node 0 \(.*\) failed: `make` exited 2: "
                       r"src/all_reduce.cu\(12\): error: identifier nccl_x is undefined") as failed:
        builder.build_here(failing)
    assert failed.value.hint == f"the whole log: {tmp_path / 'run.log'}"
    assert "error: identifier nccl_x" in (tmp_path / "run.log").read_text()


def test_nccl_tests_built_on_the_nodes_and_run_through_the_gang(local_cluster, tmp_path):
    """No nccl-tests in the image: the pinned source is staged once, built by a Ray task on each node (one
    builds, the other finds it built under the lock), and the built binaries run through the gang's mpirun.
    The node's env sets OMPI_MCA_plm=isolated, as the sandboxed GPU machine's does: mpirun then started no
    daemon on the other nodes ("All nodes which are allocated for this job are already filled") until a4ray
    asked for its rsh launcher by name."""
    sets = [*standin_toolchain(tmp_path / "tc"), f"nccl.build.source={standin_source(tmp_path)}",
            "network.env.OMPI_MCA_plm=isolated",
            "cluster.nodes=2", "cluster.gpus_per_node=1", "nccl.implementation=nccl-tests",
            "nccl.collectives=[all_reduce]", "nccl.min_bytes=64K", "nccl.max_bytes=256K", "nccl.iters=2",
            "nccl.warmup=1"]
    result = run(job("nccl_test", *sets, workspace=tmp_path / "ws"))
    assert result.ok, result.verdict
    statuses = sorted(b.status for b in result.builds)
    assert statuses in (["built", "joined"], ["built", "cached"]), statuses
    build_dir = Path(result.builds[0].path)
    assert result.binaries_dir == f"{build_dir}/src/build"
    assert build_dir.parent == tmp_path / "ws" / "builds" / "nccl-tests"
    assert (tmp_path / "ws" / "sources" / "nccl-tests").is_dir()  # the staged source
    logs = Path(result.gang.log_dir)
    built = next(b for b in result.builds if b.status == "built")
    log = (logs / "builds" / f"nccl-tests-node-{built.node:02d}.log").read_text()
    assert "NVCC_GENCODE=-gencode=arch=compute_90,code=sm_90" in log
    assert f"{result.binaries_dir}/all_reduce_perf -b 64K" in (logs / "node-00.log").read_text()
    (c,) = result.collectives
    assert len(c.run.devices) == 2 and c.busbw > 0


def test_a_failed_launch_is_said_in_the_tools_words():
    """The gang's failure as 2 x H200 printed it (mpirun's box, under OMPI_MCA_plm=isolated), and nccl-tests'
    own failure line (src/common.h NCCLCHECK's format, v2.17.6) put first where a rank printed one."""
    failure = ("node 0 (vm (127.0.0.2, sim-block-0/sim-subblock-0/sim-host-000)) exited with code 1; last lines:\n"
               "    --------------------------------------------------------------------------\n"
               "    All nodes which are allocated for this job are already filled.\n"
               "    --------------------------------------------------------------------------")
    assert tool_words.said(failure) == ("node 0 (vm (127.0.0.2, sim-block-0/sim-subblock-0/sim-host-000)) exited "
                                        "with code 1; last lines: All nodes which are allocated for this job are "
                                        "already filled.")
    own = "vm: Test NCCL failure common.cu:1041 'unhandled system error / Call to ibv_reg_mr failed'"
    assert nccl_tests.FAILURE.search(own)
    assert tool_words.said(failure, [own]) == f"{own} (node 0 (vm (127.0.0.2, sim-block-0/sim-subblock-0/" \
                                              "sim-host-000)) exited with code 1)"
