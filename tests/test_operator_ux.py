"""What operators and volunteers see (issue 16): why work waits, the end of training, the
figures after a restart, paused, the logs' limits, names, init's checks, the demo."""

from __future__ import annotations

from tests.procs import tilehive


def test_init_refuses_a_corpus_path_that_does_not_exist(tmp_path):
    result = tilehive("init", str(tmp_path / "p"), "--corpus", str(tmp_path / "no-such"))
    assert result.returncode == 2
    assert "--corpus" in result.stderr and "no such file or folder" in result.stderr
    assert not (tmp_path / "p" / "project.toml").exists()
    small = tmp_path / "small.txt"
    small.write_text("hello\n")
    result = tilehive("init", str(tmp_path / "q"), "--corpus", str(small))
    assert result.returncode == 1 and "too small" in result.stderr
    assert not (tmp_path / "q" / "project.toml").exists()
