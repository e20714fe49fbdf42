"""Benchmarks (placeholder until the engine lands)."""

if __name__ == "__main__":
    print("bench.py is not written yet")
