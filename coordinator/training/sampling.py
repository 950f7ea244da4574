"""Text from a trained checkpoint: what the model learned, byte by byte."""

from __future__ import annotations

import asyncio
import codecs
import re
from collections.abc import Iterable, Iterator

import numpy as np

from coordinator.training import checkpoints
from coordinator.training.model import TinyGPT, param_shapes, softmax_rows
from coordinator.training.project import Project, ProjectError
from coordinator.training.trainer import LocalBackend

# Control characters but newline and tab: a sampled byte must not move a terminal's cursor,
# clear its screen or change its colours.
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    """`text` with each control character but newline and tab written as an escape (\\x01)."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def as_text(chunks: Iterable[bytes]) -> Iterator[str]:
    """Bytes as printable text as they come: a character of several bytes once all of
    them have come (an empty piece before), a byte that is no UTF-8 as U+FFFD."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    for chunk in chunks:
        yield printable(decoder.decode(chunk))
    yield printable(decoder.decode(b"", final=True))


def generate(
    project: Project, prompt: str, length: int, temperature: float, seed: int
) -> Iterator[str]:
    """The prompt, then `length` sampled bytes, as text as it comes: a byte is a forward
    pass (milliseconds), and `--length 100000` printed nothing for half an hour. Nothing
    comes before the checkpoint has loaded, so a damaged one is an error, not half a line."""
    return as_text(_sampled(project, prompt, length, temperature, seed))


def _sampled(
    project: Project, prompt: str, length: int, temperature: float, seed: int
) -> Iterator[bytes]:
    """The prompt's bytes, then each byte as it is sampled."""
    step = checkpoints.latest(project.checkpoints)
    if step is None:
        raise ProjectError(f"no checkpoint in {project.checkpoints} yet: train first")
    params, _ = checkpoints.load(project.checkpoints, step, param_shapes(project.model))
    model = TinyGPT(project.model, LocalBackend())
    context = project.model.context
    tokens = list(prompt.encode()) or [10]
    rng = np.random.default_rng(seed)
    yield bytes(tokens)
    for _ in range(length):
        window = tokens[-context:]
        padded = np.zeros((1, context), np.int64)
        padded[0, : len(window)] = window
        logits, _ = asyncio.run(model.forward(params, padded))
        row = logits[len(window) - 1].astype(np.float64)
        if temperature == 0:
            tokens.append(int(row.argmax()))
        else:
            # Shifted before the division: the logits over a temperature near zero (1e-320)
            # overflow to inf, and inf - inf is NaN; shifted, they fall to -inf, which is 0.
            with np.errstate(over="ignore"):  # to -inf, on purpose
                p = softmax_rows((row - row.max()) / temperature)
            tokens.append(int(rng.choice(len(p), p=p)))
        yield bytes(tokens[-1:])
