"""Which transport NCCL chose, from its NCCL_DEBUG=INFO lines (subsystems INIT and NET).

What NCCL prints, per rank: `NCCL INFO Using network <gIB|IB|Socket>` when it picks its net plugin,
`NET/gIB : Initializing gIB v1.0.6` (gIB's plugin), `NET/IB : Using [0]mlx5_0:1/RoCE ...`,
`NET/Socket : Using [0]eth0:10.0.0.2<0>`, and per channel and peer
`Channel 00/0 : 0[0] -> 8[0] [send] via NET/gIB/0/GDRDMA` (or `via P2P/CUMEM`, `via SHM/direct/direct`).
The `via NET/...` lines show what inter-node traffic really used; `Using network` what NCCL would use.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable
from typing import Literal

from pydantic import BaseModel

_USING = re.compile(r"NCCL INFO Using network (\w+)")
_VIA = re.compile(r"NCCL INFO Channel \d+/\d+ : .*? via (NET/(\w+)\S*|[A-Z0-9]+)")
_PLUGIN = re.compile(r"NCCL INFO NET/(\w+)\s*:\s*Initializing (\w+) ?(v[\d.]+)?")
_INFO = re.compile(r"NCCL INFO ")

Expectation = Literal["gib", "ib", "rdma", "socket", "any"]
# The names NCCL prints for each expectation ("rdma": either of the RDMA transports).
_ACCEPTED = {"gib": {"gIB"}, "ib": {"IB"}, "rdma": {"gIB", "IB"}, "socket": {"Socket"}}


class TransportReport(BaseModel):
    info_lines: int = 0  # NCCL INFO lines seen (0: NCCL_DEBUG was not INFO, or NCCL never ran)
    networks: dict[str, int] = {}  # `Using network X`, per rank
    net_channels: dict[str, int] = {}  # `via NET/X/...` channel connections, by X
    local_channels: dict[str, int] = {}  # `via P2P` / `via SHM` connections
    gdr_channels: int = 0  # `via NET/.../GDRDMA`: GPUDirect RDMA in use
    plugins: list[str] = []  # `Initializing gIB v1.0.6`

    @property
    def network(self) -> str | None:
        """The network inter-node traffic used (by channel), else the one NCCL picked."""
        counts = self.net_channels or self.networks
        return max(counts, key=counts.get) if counts else None

    def describe(self) -> str:
        if not self.info_lines:
            return "unknown (no NCCL INFO lines)"
        if self.network is None:
            return "no network seen"
        parts = [f"NCCL network {self.network}"]
        if self.net_channels:
            parts.append(f"{sum(self.net_channels.values())} inter-node channel connections"
                         + (f", {self.gdr_channels} with GPUDirect RDMA" if self.gdr_channels else ""))
        else:
            parts.append("no inter-node channels (all peers on one host)")
        if self.local_channels:
            parts.append("intra-host " + ", ".join(f"{k} x{v}" for k, v in sorted(self.local_channels.items())))
        if self.plugins:
            parts.append(", ".join(self.plugins))
        return "; ".join(parts)


def parse(lines: Iterable[str]) -> TransportReport:
    report = TransportReport()
    networks: Counter[str] = Counter()
    net: Counter[str] = Counter()
    local: Counter[str] = Counter()
    plugins: dict[str, None] = {}
    for line in lines:
        if not _INFO.search(line):
            continue
        report.info_lines += 1
        if m := _USING.search(line):
            networks[m.group(1)] += 1
        elif m := _VIA.search(line):
            if m.group(2):
                net[m.group(2)] += 1
                report.gdr_channels += "GDRDMA" in m.group(1)
            else:
                local[m.group(1)] += 1
        elif m := _PLUGIN.search(line):
            plugins[" ".join(p for p in m.group(2, 3) if p)] = None
    report.networks, report.net_channels, report.local_channels = dict(networks), dict(net), dict(local)
    report.plugins = list(plugins)
    return report


def check(report: TransportReport, expect: Expectation) -> str | None:
    """None if the transport is what was expected; else what is wrong, in words a user can act on."""
    if expect == "any":
        return None
    accepted = _ACCEPTED[expect]
    if not report.info_lines:
        return (f"cannot confirm NCCL used {'/'.join(sorted(accepted))}: no NCCL INFO lines in the output "
                f"(NCCL_DEBUG must be INFO; a4ray sets it unless network.env overrides it)")
    used = set(report.net_channels) or set(report.networks)
    wrong = used - accepted
    if not used:
        return f"NCCL reported no network, expected {'/'.join(sorted(accepted))}"
    if wrong:
        fallback = "Socket" in wrong and expect != "socket"
        return (f"NCCL used {'/'.join(sorted(wrong))}, expected {'/'.join(sorted(accepted))}"
                + (": NCCL fell back to TCP sockets, so RDMA is not in use (is the gIB plugin on "
                   "LD_LIBRARY_PATH and NCCL_NET=gIB set? were the RDMA NICs given to the pod?)" if fallback else ""))
    return None
