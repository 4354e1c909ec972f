"""Free-threaded CPython 3.13t (section `free_threaded`, free_threaded.py): the GIL stays
off, stacks read as Python reads them, threads that run at once are each sampled, and tasks
keep their own tags; run in the 3.13t interpreter of ci/matrix.sh's sid root."""
