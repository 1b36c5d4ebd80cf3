"""a4ray's hook in every process of a launch while the flight recorder is on (the node actor puts this directory
first on PYTHONPATH; Python imports `sitecustomize` at startup): a rank that ends normally leaves its flight record.

Torch dumps a rank's record on NCCL's own timeout or when its debug pipe is written, never when the process ends.
A rank that ran out of data and ended with exit 0 while its peers wait for it in a collective is the commonest
uneven-work hang, and its last collectives are the evidence: which one it completed last, which one it never
joined. So at exit, a process that has torch.distributed imported and a flight record with entries writes it to
`$A4RAY_FR_EXIT_DUMP<RANK>` (a pickle, as torch's own dumps; written whole, then renamed). A data-loader worker
inherits RANK but has no entries of its own (and a forked one ends by os._exit, past atexit).

Stdlib only, and nothing of a4ray: this runs in every process of the launch, a4ray's or not. Any other
`sitecustomize` further along the path is run after it, as if this one were not there.
"""

import atexit
import importlib.machinery
import importlib.util
import os
import pickle
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


def _dump_flight_record_at_exit() -> None:
    stem, rank = os.environ.get("A4RAY_FR_EXIT_DUMP"), os.environ.get("RANK")
    if not stem or rank is None or "torch.distributed" not in sys.modules:
        return
    try:
        import torch._C._distributed_c10d as c10d  # noqa: PLC0415 - only a process that imported torch gets here

        best, entries = None, 0
        for name in ("_dump_nccl_trace", "_dump_fr_trace"):  # NCCL's recorder (CUDA builds), the generic one
            dump = getattr(c10d, name, None)
            if dump is None:
                continue
            # No C++ stack traces: symbolizing them took a rank ~10 s to exit on an H200 machine; the entries'
            # ops, sequence numbers and states are the evidence.
            raw = dump(includeCollectives=True, includeStackTraces=False, onlyActive=False)
            count = len(pickle.loads(raw).get("entries") or [])
            if count > entries:
                best, entries = raw, count
        if best is None:
            return
        path = f"{stem}{rank}"
        os.makedirs(os.path.dirname(path) or os.curdir, exist_ok=True)
        with open(f"{path}.{os.getpid()}.tmp", "wb") as f:
            f.write(best)
        os.replace(f"{path}.{os.getpid()}.tmp", path)
    except Exception:  # noqa: BLE001 - a process ending must never fail for a4ray's sake
        pass


def _chain() -> None:
    """Run the `sitecustomize` this one shadows, if any (a distribution's or a virtualenv's)."""
    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is None or spec.loader is None or os.path.dirname(os.path.abspath(spec.origin or "")) == _HERE:
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


atexit.register(_dump_flight_record_at_exit)
_chain()
