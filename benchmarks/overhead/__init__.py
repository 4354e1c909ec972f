"""What profiling costs a workload: the wall time of real workloads on a saturated
LocalCluster per profiler (section `overhead`, overhead.py), and the store's size and
RSS over a long run (section `memory`, memory.py)."""
