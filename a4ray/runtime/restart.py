"""Whether a failed gang is worth another attempt (restart.* in the spec), and why.

A lost node, a hang or an NCCL timeout is the fabric's fault: retry. A usage error, a missing module or
file, an OOM or a crash before the first iteration is the job's: another attempt would fail the same
way and burn an A4 hour. A job that succeeded is never restarted.
"""

from __future__ import annotations

import re

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
        return True, "the launch hung"
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
