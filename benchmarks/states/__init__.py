"""Thread states (section `states`): shapes of work whose states are known, in
thread_work.py (tests/inprocess/test_states.py uses them too), and the shares of wall
time the profile gives each state."""
