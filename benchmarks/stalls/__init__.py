"""Event-loop stalls (section `stalls`, stalls.py): whether the stalls the servers' loop
watches report agree with distributed's own tick measurement, say what held the loop, stay
silent on an idle cluster, and what watching costs. stalls.py's docstring says which of
its neighbours does what."""
