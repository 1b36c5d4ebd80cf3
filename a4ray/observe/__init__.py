"""Observability: progress parsing, Ray metrics, hang forensics, preflight checks."""
