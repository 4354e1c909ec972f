"""The servers' side: what runs in a scheduler or a worker (their plugins, RPC handlers,
preload hooks, event-loop activities and the dashboard's `/pyspy/` pages). Client-side
code does not import it, but to register the plugin (`cli`, `legacy`, `demo`)."""
