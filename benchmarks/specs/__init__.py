"""One module per benchmark, run as ``python -m benchmarks NAME`` (see benchmarks/harness.py)."""
