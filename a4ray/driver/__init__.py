"""The job driver: one owner of a job run. `execute` runs a spec (connect, run directory, the job its kind
names via `kinds`, the record); `main` is the command line of every job (options, printing, exit codes,
errors); `session` holds a notebook's cluster; `handle` a submitted run; `sweep` runs variants."""
