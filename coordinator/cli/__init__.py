"""The `tilehive` command line: the only place that builds concrete stores and servers."""
