"""Hand-run benchmarks: ``python -m benchmarks`` (or ``python benchmarks/run.py``)."""
