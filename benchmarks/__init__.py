"""Benchmarks: overhead, sample cost, reader oracle, attribution, rate fidelity, idle cluster, memory, collection.

Not part of the test suite: run `python -m benchmarks [--quick]` on a quiet machine.
"""
