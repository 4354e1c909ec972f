"""The sampler's tick: what a sample costs by threads and stack depth, per reader (section
`sample_cost`), what one tick costs and asks the kernel, with tick_calls.c pricing each call
(`tick_anatomy`), and the rate the CPU budget leaves against the one asked for (`rate`, a busy
cluster's phases in phases_child.py). Each section is the module of its name."""
