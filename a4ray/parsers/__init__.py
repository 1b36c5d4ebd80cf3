"""Parsers of tool output, one per format, shared by every workload that reads that format:
`nccl_tests` (nccl-tests' tables; a4ray's torch benchmark prints the same), `nccl_debug` (which
transport NCCL chose, from NCCL_DEBUG=INFO lines), `deepep_log` (DeepEP's intranode, low-latency and internode tests)."""
