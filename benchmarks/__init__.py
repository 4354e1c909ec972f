"""Benchmarks: overhead, sample cost, reader oracle, attribution, rate fidelity, idle cluster, memory, collection.

Not part of the test suite: run `python -m benchmarks [--quick]` on a quiet machine.
"""

import os

# The checkout that holds this package: child processes run from it to import benchmarks.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
