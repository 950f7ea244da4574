"""The project host: command line, and (growing) the scheduler and protocol server."""
