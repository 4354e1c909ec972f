"""Native frames (section `native`, native.py): where the time goes by library against
`py-spy record --native`, Python -> C -> Python in order (native_agreement.py), what a native
sample costs, the symbol tables' memory, fidelity and sleeps never interrupted, each measured
in a process of its own (native_child.py, started by native_runs.py)."""
