"""Benchmarks: overhead, sample cost, attribution, rate fidelity, memory, collection.

Not part of the test suite: run `python -m benchmarks [--quick]` on a quiet machine.
"""
