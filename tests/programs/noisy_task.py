"""What the conversion's verifier printed in a Ray task on an A4 node (issue 28), as the libraries print it: one
deprecation warning six times (`warnings.warn` from megatron-core's code) and one transformers logger warning
three times (transformers 5's handler: `[transformers] %(message)s` on stderr, transformers/utils/logging.py
`_configure_library_root_logger`), a line in terminal colours, a line a C library writes to fd 2, a progress bar
redrawn with \\r, and the node's secret (A4RAY_TEST_API_KEY in the session nodes' environment) in a line. Run by
`runpy.run_path` in the task; it leaves the worker's warning filters and loggers as they were."""

import logging
import os
import sys
import warnings

with warnings.catch_warnings():
    warnings.simplefilter("always")  # each copy printed, as six call sites of it would
    for _ in range(6):
        warnings.warn_explicit("load_common is deprecated and will be removed; use load_common_state_dict instead",
                               DeprecationWarning, "/venv/megatron/core/dist_checkpointing/serialization.py", 186)
handler = logging.StreamHandler(sys.stderr)
handler.setFormatter(logging.Formatter("[transformers] %(message)s"))
logger = logging.getLogger("a4ray-test.transformers")
logger.propagate = False
logger.addHandler(handler)
for _ in range(3):
    logger.warning("GPTModel IS DEPRECATED and will be removed; use GPTModel from megatron.core.models")
logger.removeHandler(handler)
print("\x1b[32mverify:\x1b[0m comparing logits", flush=True)
os.write(2, b"written by C to fd 2\n")
sys.stdout.write("loading 10%\rloading 60%\rloading 100%\n")
print(f"the node's key: {os.environ.get('A4RAY_TEST_API_KEY', '(none)')}", flush=True)
