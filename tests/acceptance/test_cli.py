"""The `tilehive` console script as a user runs it: a real subprocess."""

from __future__ import annotations

import os
import subprocess
import sys


def tilehive(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "coordinator.cli", *args]
    merged = {**os.environ, **(env or {})}
    return subprocess.run(command, capture_output=True, text=True, env=merged, timeout=120)


def test_selftest_checks_the_kernel_bit_for_bit():
    result = tilehive("selftest", "--size", "64", "--threads", "2")
    assert result.returncode == 0, result.stderr
    assert "bitwise" in result.stdout and "ok" in result.stdout
    assert "GFLOPS" in result.stdout


def test_flags_come_from_the_environment_and_bad_values_get_a_message():
    result = tilehive("selftest", env={"TILEHIVE_THREADS": "0"})
    assert result.returncode == 2
    assert "TILEHIVE_THREADS" in result.stderr and "0 is not in the range" in result.stderr
    assert "Traceback" not in result.stderr


def test_help_names_the_environment_variables():
    result = tilehive("selftest", "--help")
    assert result.returncode == 0
    assert "TILEHIVE_THREADS" in result.stdout and "TILEHIVE_SIZE" in result.stdout
