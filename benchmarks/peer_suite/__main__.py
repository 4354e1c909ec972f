"""`python -m benchmarks.peer_suite CHECKOUT ...`: see peer_suite.py."""

from benchmarks.peer_suite.peer_suite import main

main()
