"""bench.py's parts: workloads (what to run), systems (who runs it), report (what it did)."""
