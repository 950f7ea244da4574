"""Every flag of every command may come from TILEHIVE_<FLAG>, as the README promises."""

from __future__ import annotations

import json

import click

from coordinator.cli.main import main
from tests.procs import tilehive


def commands(group: click.Group, path: tuple[str, ...] = ()):
    for name, command in group.commands.items():
        yield (*path, name), command
        if isinstance(command, click.Group):
            yield from commands(command, (*path, name))


def flags(command: click.Command):
    for param in command.params:
        if isinstance(param, click.Option) and param.name not in ("help", "version"):
            yield param


def test_every_flag_of_every_command_reads_tilehive_flag():
    checked, wrong = 0, []
    for path, command in commands(main):
        for param in flags(command):
            spelling = max((o for o in param.opts if o.startswith("--")), key=len)
            expected = "TILEHIVE_" + spelling[2:].upper().replace("-", "_")
            checked += 1
            if param.envvar != expected or not param.show_envvar:
                wrong.append(f"tilehive {' '.join(path)} {spelling}: {param.envvar}")
    assert wrong == []
    assert checked > 60  # every command was walked, not just the first


def test_json_comes_from_tilehive_json_not_the_parameter_name(tmp_path):
    assert tilehive("init", str(tmp_path / "p"), "--steps", "3").returncode == 0
    result = tilehive("volunteer", "status", "--state-dir", str(tmp_path / "v"))
    assert result.returncode == 3 and not result.stdout.startswith("{")
    as_json = tilehive(
        "volunteer", "status", "--state-dir", str(tmp_path / "v"), env={"TILEHIVE_JSON": "1"}
    )
    assert json.loads(as_json.stdout)["running"] is False
    stopped = tilehive("volunteer", "stop", "--state-dir", str(tmp_path / "v"))
    assert stopped.returncode == 0 and "no volunteer is running" in stopped.stdout
    assert not (tmp_path / "v").exists()  # asking about a volunteer creates nothing
    keep = tilehive("demo", "--help", env={"TILEHIVE_DIR": str(tmp_path)})
    assert "TILEHIVE_DIR" in keep.stdout and "TILEHIVE_DIRECTORY" not in keep.stdout
