"""The hang verdict's rules of evidence, on real flight records: those torch 2.13 served from four gloo ranks
(2 nodes x 2) of which rank 3 never entered the 4th all-reduce (tests/fixtures/flight_recorder_gloo/, taken
from test_culprits' run through the ranks' c10d worker servers). Who is named, and on what, when a record or a
stack is missing or disagrees."""

from __future__ import annotations

import copy
import json

from conftest import REPO

from a4ray.observe.flight import NoRecord, analyze, match
from a4ray.observe.hang import judge
from a4ray.observe.ras import Finding
from a4ray.observe.stacks import StackDump
from a4ray.observe.verdicts import NodeRef
from a4ray.runtime.launch import GangResult, NodeResult
from a4ray.runtime.restart import blamed_nodes, keep_off, should_retry
from a4ray.spec.resilience import RestartSpec

RECORDS = {r: json.loads((REPO / "tests" / "fixtures" / "flight_recorder_gloo" / f"rank_{r}.json").read_text())
           for r in range(4)}
NODES = [NodeRef(node=0, host="sim-host-001", ip="127.0.0.2"), NodeRef(node=1, host="sim-host-002", ip="127.0.0.3")]
NPROC = [2, 2]
WAITING = [StackDump(rank=str(r), node=r // 2, pid=100 + r, where="all_reduce (distributed_c10d.py:3252)")
           for r in range(3)]


def test_every_record_names_the_rank_that_never_entered_the_collective():
    m = match(RECORDS, [0, 1, 2, 3])
    assert (m.collective.seq, m.collective.op, m.waiting, m.never_joined) == (4, "gloo:all_reduce", [0, 1, 2], [3])
    assert m.members_known
    # torch's own analyzer, run for the hang report, refuses gloo's records (their group is named "" in pg_config)
    assert analyze(RECORDS)[0].startswith("torch's analyzer refused these records (KeyError")
    verdict = judge(RECORDS, {}, [], NODES, NPROC)
    assert [(c.rank, c.node.host) for c in verdict.culprits] == [(3, "sim-host-002")]
    assert verdict.line().startswith("culprit: rank 3 on node 1 (sim-host-002, 127.0.0.3) "
                                     "never joined gloo:all_reduce #4 of process group default, sizes [[4]]")


TIMED_OUT = NoRecord(reason="timed out", detail="its flight-record server did not answer in 10s")


def test_a_rank_without_a_record_is_judged_by_its_stack():
    records = {r: RECORDS[r] for r in range(3)}
    elsewhere = StackDump(rank="3", node=1, pid=103, where="load_batch (stuck.py:8)")
    verdict = judge(records, {3: TIMED_OUT}, [*WAITING, elsewhere], NODES, NPROC)
    assert [c.rank for c in verdict.culprits] == [3] and verdict.culprits[0].where == "load_batch (stuck.py:8)"
    assert verdict.evidence == ["flight recorder of rank(s) 0-2", "stacks of rank(s) 3"]
    assert not verdict.undetermined


def test_the_evidence_rule_on_complete_partial_and_full_records():
    """Complete records name the rank whose own record stops at #3; "did not answer" names no one: one rank
    missing beside the culprit's record is not judged, the culprit's own record missing (alone or with
    another's) leaves the verdict undetermined, naming the candidates and why each gave no evidence; every rank
    answering from inside #4 is the fabric or a desync, not undetermined."""
    complete = judge(RECORDS, {}, [], NODES, NPROC)
    assert [c.rank for c in complete.culprits] == [3] and not complete.undetermined
    assert complete.culprits[0].why == "its flight record stops before #4"

    # One missing, not the culprit: rank 1 (it entered #4) cannot answer; rank 3's own record names it alone.
    one = judge({r: RECORDS[r] for r in (0, 2, 3)}, {1: TIMED_OUT}, [], NODES, NPROC)
    assert [c.rank for c in one.culprits] == [3] and not one.undetermined and one.waiting == [0, 2]
    assert "rank(s) 1 not judged: no evidence either way (timed out)" in one.note

    # One missing, the culprit: the others wait in #4, nothing says why rank 3 is not there.
    alone = judge({r: RECORDS[r] for r in range(3)}, {3: TIMED_OUT}, [], NODES, NPROC)
    assert alone.culprits == [] and alone.undetermined and [c.rank for c in alone.candidates] == [3]
    assert alone.candidates[0].why == ("no flight record: timed out (its flight-record server did not answer in "
                                       "10s); no stack")
    assert alone.line().startswith("undetermined: ranks 0-2 wait in gloo:all_reduce #4 of process group default")

    # Several missing: the culprit and a rank frozen inside #4.
    frozen = StackDump(rank="1", node=0, pid=101, stopped=True,
                       where="a stopped process (state T) in all_reduce (distributed_c10d.py:3252)")
    several = judge({0: RECORDS[0], 2: RECORDS[2]}, {1: TIMED_OUT, 3: TIMED_OUT}, [frozen], NODES, NPROC)
    assert several.culprits == [] and several.undetermined and [c.rank for c in several.candidates] == [1, 3]
    assert "its stack (a stopped process (state T) in all_reduce" in several.candidates[0].why
    assert "no culprit named" in several.line() and "rank 1 on node 0 (sim-host-001): no flight record" in \
        several.line()

    # All answering, every rank inside #4: the fabric or a desync.
    inside = copy.deepcopy(RECORDS[3])
    inside["entries"].append({**RECORDS[0]["entries"][-1]})
    inside["pg_status"]["0"]["last_enqueued_collective"] = "4"
    everyone = judge({**RECORDS, 3: inside}, {}, [], NODES, NPROC)
    assert everyone.culprits == [] and not everyone.undetermined and everyone.waiting == [0, 1, 2, 3]
    assert everyone.note == "every member of the group is inside #4: the fabric, or a rank frozen there, not one rank"


def test_a_gone_process_a_stack_outside_and_ras_are_evidence_a_stack_frozen_inside_is_not():
    records = {r: RECORDS[r] for r in range(3)}
    gone = judge(records, {3: NoRecord(reason="process gone", detail="its process had exited")}, [], NODES, NPROC)
    assert [(c.rank, c.where, c.why) for c in gone.culprits] == [(3, "exited", "its process is gone")]
    assert gone.evidence == ["flight recorder of rank(s) 0-2", "exit of rank(s) 3"]
    stopped_out = StackDump(rank="3", node=1, pid=103, stopped=True, where="a stopped process (state T) in "
                            "load_batch (stuck.py:8)")
    assert [c.rank for c in judge(records, {3: TIMED_OUT}, [stopped_out], NODES, NPROC).culprits] == [3]
    stopped_in = stopped_out.model_copy(update={"where": "a stopped process (state T) in all_reduce (x.py:1)"})
    assert judge(records, {3: TIMED_OUT}, [stopped_in], NODES, NPROC).undetermined
    behind = Finding(kind="missing-ops", detail="launched up to AllReduce operation 3 while rank(s) 0-2 of its "
                     "communicator launched up to 4", pid=103, host="127.0.0.3")
    by_ras = judge(records, {3: TIMED_OUT}, [], NODES, NPROC, {3: behind})
    assert [(c.rank, c.why) for c in by_ras.culprits] == [(3, "NCCL RAS")] and "NCCL RAS on rank(s) 3" in by_ras.evidence
    teardown = behind.model_copy(update={"kind": "unresponsive", "detail": "sent RAS no communicator data"})
    assert judge(records, {3: TIMED_OUT}, [], NODES, NPROC, {3: teardown}).undetermined


def test_a_rank_that_ended_before_the_collective_its_peers_wait_in_is_named_with_what_it_did_last():
    """Rank 3's record stops after #3 (as the record it leaves at its exit does); it ended with exit 0 while ranks
    0-2 wait in #4: named for its end, with the last collective it completed, and no node is blamed for a program
    that ran out of work. Had it joined #4, its end would not be the cause."""
    left = {**RECORDS, 3: {**RECORDS[3], "a4ray_ended": True}}
    verdict = judge(left, {}, [], NODES, NPROC, ended={3: (0, 1000.0)})
    assert verdict.kind == "ended" and [c.rank for c in verdict.culprits] == [3] and verdict.waiting == [0, 1, 2]
    assert verdict.line().startswith("rank 3 (node 1 (sim-host-002, 127.0.0.3)) ended with exit 0 after all_reduce #3 "
                                     "of group default; ranks 0-2 wait in all_reduce #4 of group default, which it "
                                     "never joined (evidence: flight recorder of rank(s) 0-3, end of rank(s) 3)")
    result = GangResult(job="j", launch_id="l", ok=False, failure_kind="hang", failed_node=1, hang_verdict=verdict)
    assert blamed_nodes(result) == {}
    # Stacks alone (a user's gloo program serves no record): the live ranks wait in a collective.
    by_stacks = judge({3: left[3]}, {}, WAITING, NODES, NPROC, ended={3: (0, 1000.0)})
    assert by_stacks.kind == "ended" and [c.rank for c in by_stacks.culprits] == [3]
    assert "ranks 0-2 wait in all_reduce (distributed_c10d.py:3252), which it never joined" in by_stacks.line()
    # Ended, but its peers compute: not a hang (yet).
    computing = [s.model_copy(update={"where": "forward (train.py:9)"}) for s in WAITING]
    assert judge({3: left[3]}, {}, computing, NODES, NPROC, ended={3: (0, 1000.0)}).waiting == []


def test_a_desync_names_the_minority_with_each_sides_call_and_blames_no_one_where_no_side_is():
    """Rank 2 entered all_gather_into_tensor as its #4 where ranks 0, 1 and 3 entered all_reduce #4 (the fixture's
    rank 3 given the others' #4): the minority is named with both calls; two against two names both sides and
    blames no one. Without records, the stacks' collectives say the same."""
    records = copy.deepcopy(RECORDS)
    records[3]["entries"].append(copy.deepcopy(RECORDS[0]["entries"][-1]))
    odd = records[2]["entries"][-1]
    odd.update(profiling_name="gloo:all_gather_into_tensor", input_sizes=[[4096]], input_dtypes=["Float"])
    verdict = judge(records, {}, [], NODES, NPROC)
    assert verdict.kind == "desync" and [c.rank for c in verdict.culprits] == [2], verdict.line()
    assert verdict.line().startswith("desync: rank 2 called all_gather_into_tensor #4 ([4096] Float) while ranks 0-1, "
                                     "3 called all_reduce #4 ([4] Float)"), verdict.line()
    records[3]["entries"][-1] = copy.deepcopy(odd)
    even = judge(records, {}, [], NODES, NPROC)
    assert even.kind == "desync" and even.culprits == [] and "no side is the minority, no one is blamed" in even.line()
    gather = StackDump(rank="3", node=1, pid=103, where="all_gather_into_tensor (distributed_c10d.py:4012)")
    by_stacks = judge({}, {}, [*WAITING, gather], NODES, NPROC)
    assert by_stacks.kind == "desync" and [c.rank for c in by_stacks.culprits] == [3]
    assert by_stacks.line().startswith("desync: rank 3 called all_gather_into_tensor while ranks 0-2 called all_reduce")


def test_an_undetermined_verdict_keeps_no_node_off_and_blames_no_host():
    records = {0: RECORDS[0], 2: RECORDS[2]}
    verdict = judge(records, {1: TIMED_OUT, 3: TIMED_OUT}, [], NODES, NPROC)
    node = NodeResult(rank=1, gang_rank=1, hostname="sim-host-002", host="sim-host-002", ip="127.0.0.3",
                      node_id="x", location="", status="failed", exit_code=None)
    result = GangResult(job="j", launch_id="l", ok=False, failure="hung", failure_kind="hang", failed_node=1,
                        nodes=[node], hang_verdict=verdict)
    assert blamed_nodes(result) == {} and keep_off(result, blamed_nodes(result)) == {}
    retry, why = should_retry(result, RestartSpec(max_restarts=1), 0)
    assert retry and why.startswith("the launch hung (undetermined: ")
    named = result.model_copy(update={"hang_verdict": judge(RECORDS, {}, [], NODES, NPROC)})
    assert list(blamed_nodes(named)) == ["sim-host-002"]


def test_stacks_alone_name_the_rank_outside_the_collective_and_nothing_names_no_one():
    elsewhere = StackDump(rank="3", node=1, pid=103, where="load_batch (stuck.py:8)")
    no_server = {r: NoRecord(reason="no server", detail="not an a4ray program") for r in range(4)}
    verdict = judge({}, no_server, [*WAITING, elsewhere], NODES, NPROC)
    assert [c.rank for c in verdict.culprits] == [3] and verdict.collective is None and verdict.waiting == [0, 1, 2]
    assert judge({}, {}, [], NODES, NPROC).culprits == []
    all_inside = [*WAITING, StackDump(rank="3", node=1, pid=103, where="all_reduce (distributed_c10d.py:3252)")]
    assert judge({}, {}, all_inside, NODES, NPROC).culprits == []
    # The ranks with stacks wait in a collective, rank 3 gave none: undetermined.
    silent = judge({}, no_server, WAITING, NODES, NPROC)
    assert silent.undetermined and [c.rank for c in silent.candidates] == [3]
    # No py-spy on the nodes and no records (the soak on a machine without py-spy, its rank 1 SIGSTOPped): stacks
    # that say nowhere are no evidence that the ranks are outside a collective; the verdict says it has none.
    missing = "py-spy is not installed on this node (pip install py-spy)"
    blind = [StackDump(rank=str(r), node=r // 2, pid=100 + r, error=missing, stopped=r == 1,
                       where="a stopped process (state T)" if r == 1 else "") for r in range(4)]
    unknown = judge({}, {}, blind, NODES, NPROC)  # the flight recorder off: no records asked
    assert unknown.culprits == [] and unknown.evidence == [] and not unknown.waiting
    assert unknown.note.endswith(f"and no stacks ({missing})") and "not a collective's" not in unknown.note


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


def test_a_few_milliseconds_of_jitter_on_a_short_step_is_no_straggler():
    """The figures an even 2 x 2 H200 gang read (straggler_ep, 20 ms steps): node 1 16% above the gang's median for
    2 windows, 3 ms a step. Above the threshold, under `min_slower_s`: not flagged; the slowed run's 18 ms is."""
    from a4ray.observe.straggler import ComputeWindow, StragglerCheck
    from a4ray.spec.resilience import StragglerSpec

    spec = StragglerSpec(windows=2)
    even = StragglerCheck(spec, NODES, [2, 2], ("job", "run-even"))
    for i in range(3):  # node 1: 0.02325 s against the gang's 0.02005 (16% above, 3.2 ms)
        assert even.window(ComputeWindow(iteration=5 * (i + 1), seconds=[0.0170, 0.0171, 0.0232, 0.0233])) == []
    slowed = StragglerCheck(spec, NODES, [2, 2], ("job", "run-slowed"))
    flagged = [list(slowed.window(ComputeWindow(iteration=5 * (i + 1), seconds=[0.040, 0.041, 0.058, 0.059])))
               for i in range(2)]
    assert [[s.node.node for s in f] for f in flagged] == [[], [1]]
