"""Activities (section `activities`, activities.py): what naming the event loops costs per
message, whether the small-tasks workload slows, and how much of the loops' time gets a name."""
