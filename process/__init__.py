"""What any long-running Shoal process does for itself that is not the log: handing memory back
to the system (``memory``). Imports nothing of Shoal's; the projector, the services and the
command line import it."""
