"""What every layer of a4ray stands on: typed errors, secret redaction, console lines, typed results, the run directory.
"""
