"""The volunteer's systemd unit, shipped as a file."""
