"""Whether a failed gang is worth another attempt (restart.* in the spec), and why; which nodes its failure
is attributed to, and which nodes the next attempt keeps off.

A lost node, a hang or an NCCL timeout is the fabric's fault: retry. A usage error, a missing module or
file, an OOM or a crash before the first iteration is the job's: another attempt would fail the same
way and burn an A4 hour. A job that succeeded is never restarted.
"""

from __future__ import annotations

import re

from a4ray.core.node_history import NodeEventKind
from a4ray.runtime.launch import GangResult
from a4ray.spec.resilience import RestartSpec


def should_retry(result: GangResult, policy: RestartSpec, attempt: int) -> tuple[bool, str]:
    if result.ok:
        return False, "the job succeeded"
    kind = result.failure_kind
    if kind in ("cancelled", "timeout"):
        return False, f"the job was {'cancelled' if kind == 'cancelled' else 'past its timeout_s'}"
    if attempt >= policy.max_restarts:
        return False, f"restart.max_restarts={policy.max_restarts} reached"
    if kind == "lost":
        return True, f"node {result.failed_node} was lost"
    if kind == "hang":
        verdict = result.hang_verdict
        if verdict is not None and verdict.culprits:
            return True, f"the launch hung on {', '.join(f'rank {c.rank} ({c.node.host})' for c in verdict.culprits)}"
        return True, "the launch hung" + (f" ({verdict.line()})" if verdict is not None else "")
    node = next((n for n in result.nodes if n.rank == result.failed_node), None)
    code = node.exit_code if node else None
    text = "\n".join((node.last_lines if node else []) + [result.failure or ""])
    if code is not None and code in policy.retry_exit_codes:
        return True, f"exit code {code} is in restart.retry_exit_codes"
    if code is not None and code in policy.never_exit_codes:
        return False, f"exit code {code} is in restart.never_exit_codes (a usage/config error)"
    for pattern in policy.never_patterns:
        if m := re.search(pattern, text):
            return False, f"the output shows {m.group(0)!r}, which another attempt would not fix"
    for pattern in policy.retry_patterns:
        if m := re.search(pattern, text):
            return True, f"the output shows {m.group(0)!r}"
    if code is not None and (code < 0 or code in (128 + 9, 128 + 15)):
        return True, f"a process was killed by a signal (exit code {code})"
    if policy.unknown == "retry":
        return True, "restart.unknown=retry"
    if policy.unknown == "retry-if-progressed" and result.iterations_seen:
        return True, f"it failed after making progress (iteration {result.last_iteration})"
    return False, "it failed before its first iteration, which looks like configuration, not the fabric"


def blamed_nodes(result: GangResult) -> dict[str, tuple[NodeEventKind, str]]:
    """The hosts a failed launch is attributed to, each with what happened: the node that was lost, the nodes
    of a hang verdict's culprits (the watchdog's or NCCL's timeout's; not those of a rank that ended early or a
    desync: the program's). Nothing else is any one node's fault on the evidence a4ray has."""
    if result.ok:
        return {}
    by_gang_rank = {n.gang_rank: n for n in result.nodes}
    if result.failure_kind == "lost" and result.failed_node in by_gang_rank:
        node = by_gang_rank[result.failed_node]
        return {node.host or node.hostname: ("lost", f"node {node.gang_rank} ({node.ip}) was lost in launch "
                                                     f"{result.launch_id}")}
    blamed: dict[str, tuple[NodeEventKind, str]] = {}
    # A hang, or NCCL's own timeout of a collective. A rank that ended early or called another collective is the
    # program's doing, not its node's.
    if result.hang_verdict is not None and result.hang_verdict.kind == "hang":
        verdict = result.hang_verdict
        for c in verdict.culprits:
            what = f"never joined {verdict.collective.describe()}" if verdict.collective else f"was in {c.where}"
            blamed.setdefault(c.node.host, ("hang-culprit", f"rank {c.rank} on node {c.node.node} {what} "
                                                            f"(evidence: {', '.join(verdict.evidence)})"))
    return blamed


def keep_off(result: GangResult, blamed: dict[str, tuple[NodeEventKind, str]]) -> dict[str, str]:
    """The hosts the next attempt keeps off, each with why: the nodes the failure is attributed to (`blamed`,
    from `blamed_nodes`), and the nodes flagged stragglers in the launch (the gang waited for them every step; a
    restart is the moment to leave them, where the cluster has other nodes)."""
    hosts = {host: why for host, (_, why) in blamed.items()}
    for s in result.stragglers:
        hosts.setdefault(s.node.host, f"node {s.node.node} ({s.node.ip}) was a straggler in launch "
                                      f"{result.launch_id}, {s.slower_pct:.0f}% slower than the gang's median")
    return hosts
