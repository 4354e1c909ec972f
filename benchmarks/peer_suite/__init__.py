"""distributed's own tests, with and without our preloads (sections `peer_suite` and
`peer_suite_native` of RESULTS.md): not run by `python -m benchmarks`, as it needs a source
checkout of distributed; `python -m benchmarks.peer_suite CHECKOUT`, see peer_suite.py."""
