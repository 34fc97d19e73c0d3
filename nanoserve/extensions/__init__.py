"""Optional ideas on top of the core, one module each, imported only when their setting is on.

Delete the folder and the core still runs."""
