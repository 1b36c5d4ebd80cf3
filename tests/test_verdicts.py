"""The hang verdict's rules of evidence, on real flight records: those torch 2.13 served from four gloo ranks
(2 nodes x 2) of which rank 3 never entered the 4th all-reduce (tests/fixtures/flight_recorder_gloo/, taken
from test_culprits' run through the ranks' c10d worker servers). Who is named, and on what, when a record or a
stack is missing or disagrees."""

from __future__ import annotations

import json

from conftest import REPO

from a4ray.observe.flight import match
from a4ray.observe.hang import judge
from a4ray.observe.stacks import StackDump
from a4ray.observe.verdicts import NodeRef

RECORDS = {r: json.loads((REPO / "tests" / "fixtures" / "flight_recorder_gloo" / f"rank_{r}.json").read_text())
           for r in range(4)}
NODES = [NodeRef(node=0, host="sim-host-001", ip="127.0.0.2"), NodeRef(node=1, host="sim-host-002", ip="127.0.0.3")]
NPROC = [2, 2]
WAITING = [StackDump(rank=str(r), node=r // 2, pid=100 + r, where="all_reduce (distributed_c10d.py:3252)")
           for r in range(3)]


def test_every_record_names_the_rank_that_never_entered_the_collective():
    m = match(RECORDS, [0, 1, 2, 3])
    assert (m.collective.seq, m.collective.op, m.waiting, m.never_joined) == (4, "gloo:all_reduce", [0, 1, 2], [3])
    assert m.members_known and "torch's analyzer refused these records (KeyError" in m.note
    verdict = judge(RECORDS, {}, [], NODES, NPROC)
    assert [(c.rank, c.node.host) for c in verdict.culprits] == [(3, "sim-host-002")]
    assert verdict.line().startswith("culprit: rank 3 on node 1 (sim-host-002, 127.0.0.3) "
                                     "never joined gloo:all_reduce #4 of process group default, sizes [[4]]")


def test_a_rank_without_a_record_is_judged_by_its_stack():
    records = {r: RECORDS[r] for r in range(3)}
    elsewhere = StackDump(rank="3", node=1, pid=103, where="load_batch (stuck.py:8)")
    verdict = judge(records, {3: "did not answer"}, [*WAITING, elsewhere], NODES, NPROC)
    assert [c.rank for c in verdict.culprits] == [3] and verdict.culprits[0].where == "load_batch (stuck.py:8)"
    assert verdict.evidence == ["flight recorder of rank(s) 0-2", "stacks of rank(s) 3"]


def test_a_rank_with_neither_record_nor_stack_is_named_only_as_the_one_the_whole_group_waits_for():
    records = {r: RECORDS[r] for r in range(3)}
    verdict = judge(records, {3: "did not answer"}, WAITING, NODES, NPROC)
    assert [c.rank for c in verdict.culprits] == [3] and verdict.culprits[0].where == "did not answer"
    assert "answered neither flight record nor stack dump, while every other member waits" in verdict.note


def test_evidence_that_disagrees_names_no_one():
    """Rank 3 gave no record, and its stack says it waits in a collective too: a desync or the fabric."""
    records = {r: RECORDS[r] for r in range(3)}
    inside = StackDump(rank="3", node=1, pid=103, where="all_reduce (distributed_c10d.py:3252)")
    verdict = judge(records, {3: "did not answer"}, [*WAITING, inside], NODES, NPROC)
    assert verdict.culprits == [] and verdict.line().startswith("no culprit named: ")
    assert "rank(s) 3 gave no record but their stacks are in a collective" in verdict.note


def test_stacks_alone_name_the_rank_outside_the_collective_and_nothing_names_no_one():
    elsewhere = StackDump(rank="3", node=1, pid=103, where="load_batch (stuck.py:8)")
    verdict = judge({}, {r: "no flight-record server (not an a4ray program)" for r in range(4)},
                    [*WAITING, elsewhere], NODES, NPROC)
    assert [c.rank for c in verdict.culprits] == [3] and verdict.collective is None and verdict.waiting == [0, 1, 2]
    assert judge({}, {}, [], NODES, NPROC).culprits == []
    all_inside = [*WAITING, StackDump(rank="3", node=1, pid=103, where="all_reduce (distributed_c10d.py:3252)")]
    assert judge({}, {}, all_inside, NODES, NPROC).culprits == []


def test_a_straggler_is_flagged_after_its_windows_and_its_gauge_stays_up_after_a_recovery(monkeypatch):
    """The straggler rule window by window, with the gauge each window sets (recorded here, not exported)."""
    from a4ray.observe import metrics
    from a4ray.observe.straggler import ComputeWindow, StragglerCheck
    from a4ray.spec.resilience import StragglerSpec

    gauges = []
    monkeypatch.setattr(metrics, "record_node_window",
                        lambda job, run, node, t, straggler: gauges.append((node.node, straggler)))
    nodes = [*NODES, NodeRef(node=2, host="sim-host-003", ip="127.0.0.4")]
    check = StragglerCheck(StragglerSpec(threshold=1.0, windows=2), nodes, [1, 1, 1], ("job", "run"))
    seconds = [[0.02, 0.021, 0.09], [0.02, 0.02, 0.08], [0.02, 0.022, 0.021], [0.02, 0.02, 0.02]]
    flagged = [[s.node.node for s in check.window(ComputeWindow(iteration=4 * (i + 1), seconds=s))]
               for i, s in enumerate(seconds)]
    assert flagged == [[], [2], [2], [2]]
    assert check.flagged[0].iteration == 8 and check.flagged[0].slower_pct > 200 and check.flagged[0].times == 1
    by_window = [gauges[i:i + 3] for i in range(0, len(gauges), 3)]
    assert by_window == [[(0, False), (1, False), (2, w >= 1)] for w in range(4)]
    # Slow again after it caught up: said again; still one entry for the node, counting it, with the latest figures.
    for iteration, s in ((20, [0.02, 0.02, 0.07]), (24, [0.02, 0.02, 0.06])):
        again = check.window(ComputeWindow(iteration=iteration, seconds=s))
    assert [(a.node.node, a.times, a.iteration) for a in again] == [(2, 2, 24)]
    assert again[0].line().endswith("up to iteration 24 (flagged 2 times in this launch)")
    # A node only once slower than the threshold (not for 2 windows in a row) is never flagged.
    once = StragglerCheck(StragglerSpec(threshold=1.0, windows=2), nodes, [1, 1, 1], ("job", "run"))
    assert [once.window(ComputeWindow(iteration=i, seconds=[0.09, 0.02, 0.02])) for i in (4,)] == [[]]
    assert once.window(ComputeWindow(iteration=8, seconds=[0.02, 0.02, 0.02])) == [] and once.flagged == []
