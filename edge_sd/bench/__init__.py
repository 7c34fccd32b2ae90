"""The benchmark harness behind `edge-sd bench` and `benchmarks/real_pair.py`."""
