"""Pipelines: a recipe's steps (`steps`) run in order by the `runner.Pipeline` job, on one connection and
in one run directory; `rehearsal` picks a recipe's local profile and says what the same run does on A4;
`nodefs` reads and writes small files on a node where the workspace is mounted."""
