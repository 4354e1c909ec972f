"""The sampler's history: a day of samples in each worker's store, collected (section
`retention`), windows over folded history (`history_windows`), how late ticks begin while
the history is exported (`export_lateness`, each run in export_lateness_child.py), and
saved profiles loaded within bounds (`bounded_loads`). Each section is the module of its name."""
