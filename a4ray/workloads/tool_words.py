"""A failed launch of an outside tool, said in the tool's own words rather than only as an exit code.

The gang's failure reads `node 0 (...) exited with code 1; last lines:` followed by the node's last lines;
the tool's own line (nccl-tests' `Test NCCL failure ...`, DeepEP's `DeepEP timeout for dispatch receivers`,
mpirun's boxed message) is what says what happened, so it comes first.
"""

from __future__ import annotations

import re

_WORDS = re.compile(r"[A-Za-z]{3}")


def said(failure: str | None, own: list[str] = ()) -> str:
    """One line: the tool's own first failure line where it printed one, else the launch's first line with
    the first meaningful one of the last lines it quotes (skipping mpirun's `-----` box edges)."""
    lines = (failure or "the launch failed").splitlines()
    head = lines[0].strip()
    if own:
        return f"{own[0].strip()} ({head.removesuffix('; last lines:').removesuffix(' last lines:')})"
    if head.endswith("last lines:"):
        quoted = next((line.strip() for line in lines[1:] if _WORDS.search(line)), "")
        return f"{head} {quoted}".strip() if quoted else head.removesuffix("; last lines:")
    return head
