"""How many micro-batches a new project gets, and that what it is given is what it keeps."""

from __future__ import annotations

from coordinator.training import project as projects

LARGER = {
    "model.layers": 4,
    "model.width": 512,
    "model.heads": 8,
    "model.context": 128,
    "training.batch_size": 32,
}


def test_a_small_model_is_one_micro_batch_and_a_large_one_two(tmp_path):
    # tiny-gpt's products are too short to hide the coordinator's work on the other part.
    tiny = projects.create(tmp_path / "tiny")
    assert tiny.training.micro_batches == 1
    larger = projects.create(tmp_path / "larger", **LARGER)
    assert larger.training.micro_batches == 2
    # Written into project.toml, so loading it (and --local) sees the same number.
    assert projects.load(tmp_path / "tiny").training.micro_batches == 1
    assert projects.load(tmp_path / "larger").training.micro_batches == 2


def test_an_explicit_setting_wins_and_an_odd_batch_is_one_part(tmp_path):
    chosen = projects.create(tmp_path / "chosen", **{"training.micro_batches": 2})
    assert chosen.training.micro_batches == 2
    odd = projects.create(tmp_path / "odd", **{**LARGER, "training.batch_size": 31})
    assert odd.training.micro_batches == 1


def test_a_project_toml_without_the_key_keeps_two(tmp_path):
    # Written by hand before the choice existed: its steps must stay what they were.
    projects.create(tmp_path / "old")
    toml = tmp_path / "old" / projects.PROJECT_FILE
    text = "\n".join(
        line for line in toml.read_text().splitlines() if not line.startswith("micro_batches")
    )
    toml.write_text(text)
    assert projects.load(tmp_path / "old").training.micro_batches == 2
