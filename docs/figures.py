"""The docs' figures, made from real runs with the code a notebook uses (nothing here draws by hand).

    python docs/figures.py goodput RUN_DIR     docs/img/goodput-timeline.png: a run's goodput time line

RUN_DIR is a run directory with a goodput record, e.g. the rehearsal's (`make rehearsal`, then the newest
`.a4ray/runs/qwen3-next-local-*`). The chart is `a4ray.goodput(run).plot()`, as in
notebooks/qwen3_next_rehearsal.ipynb.

The dashboard's screenshot (docs/img/dashboard-jobs.png) comes from the dashboard test's headless Chromium:
`A4RAY_DOCS_SCREENSHOTS=$PWD/docs/img .venv/bin/pytest tests/test_dashboard.py -k browser -p no:xdist`.
This is a docs tool: nothing in a4ray imports it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as `python docs/figures.py` from anywhere
    sys.path.insert(0, str(REPO))

IMG = REPO / "docs" / "img"


def goodput(run_dir: Path, out: Path) -> Path:
    """The run's goodput time line (one bar per attempt, coloured by bucket) as a PNG."""
    import matplotlib

    matplotlib.use("Agg")  # no display: a file
    import matplotlib.pyplot as plt

    import a4ray

    record = a4ray.goodput(run_dir)
    ax = record.plot()
    ax.figure.savefig(out, dpi=150, bbox_inches="tight", metadata={"Software": None})  # same bytes for the same run
    plt.close(ax.figure)
    print(f"wrote {out.relative_to(REPO) if out.is_relative_to(REPO) else out}: {record.line()}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python docs/figures.py", description=__doc__.split("\n\n")[0])
    figures = parser.add_subparsers(dest="figure", required=True)
    chart = figures.add_parser("goodput", help="a run's goodput time line")
    chart.add_argument("run_dir", type=Path, help="a run directory with a goodput record (its result.json)")
    chart.add_argument("-o", "--output", type=Path, default=IMG / "goodput-timeline.png", help="default: %(default)s")
    args = parser.parse_args(argv)
    if not (args.run_dir / "result.json").is_file():
        parser.error(f"{args.run_dir}: no result.json (give a run directory: <workspace>/runs/<id>)")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    goodput(args.run_dir, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
