"""`python -m coordinator.cli`: the same as the `tilehive` command."""

from coordinator.cli.main import main

main(prog_name="tilehive")
