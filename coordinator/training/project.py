"""A project: one training run in one directory, described by its project.toml."""

from __future__ import annotations

import contextlib
import dataclasses
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from coordinator.rules.access import admin_token, networks
from coordinator.work.records import Policy, Redundancy

PROJECT_FILE = "project.toml"
MODELS = ("tiny-gpt",)


class ProjectError(ValueError):
    """project.toml is missing, malformed, or holds a setting out of range."""


@dataclass(frozen=True)
class ModelSettings:
    name: str = "tiny-gpt"
    layers: int = 2
    width: int = 128
    heads: int = 4
    context: int = 64


@dataclass(frozen=True)
class CorpusSettings:
    source: str = "python-stdlib"
    max_mb: int = 16
    validation_share: float = 0.05


@dataclass(frozen=True)
class TrainingSettings:
    steps: int = 50
    batch_size: int = 16
    seed: int = 0
    checkpoint_every: int = 10
    eval_every: int = 10
    # The batch is cut into this many micro-batches whose products are in flight together,
    # so the coordinator's element-wise work on one overlaps the volunteers' on another.
    # Their gradients are summed in a fixed order: --local uses the same setting, same bits.
    micro_batches: int = 2


@dataclass(frozen=True)
class OptimizerSettings:
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 5
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    grad_clip: float = 1.0


@dataclass(frozen=True)
class WorkSettings:
    tile: int = 128
    sizing: str = "crowd"
    policy: str = "quorum"
    freivalds_rounds: int = 8
    target_nresults: int = 2
    min_quorum: int = 2
    max_error_results: int = 4
    max_total_results: int = 24
    delay_bound: float = 60.0
    adaptive_replication: bool = False


@dataclass(frozen=True)
class AccessSettings:
    invite_code: str = ""
    host_rate: float = 200.0
    registrations_per_hour: int = 30
    trusted_proxies: str = ""


@dataclass(frozen=True)
class Project:
    directory: Path
    model: ModelSettings = field(default_factory=ModelSettings)
    corpus: CorpusSettings = field(default_factory=CorpusSettings)
    training: TrainingSettings = field(default_factory=TrainingSettings)
    optimizer: OptimizerSettings = field(default_factory=OptimizerSettings)
    work: WorkSettings = field(default_factory=WorkSettings)
    access: AccessSettings = field(default_factory=AccessSettings)

    @property
    def checkpoints(self) -> Path:
        return self.directory / "checkpoints"

    @property
    def policy(self) -> Policy:
        return Policy(self.work.policy)

    @property
    def redundancy(self) -> Redundancy:
        w = self.work
        return Redundancy(
            w.target_nresults,
            w.min_quorum,
            w.max_error_results,
            w.max_total_results,
            w.delay_bound,
        )


SECTIONS = {
    "model": ModelSettings,
    "corpus": CorpusSettings,
    "training": TrainingSettings,
    "optimizer": OptimizerSettings,
    "work": WorkSettings,
    "access": AccessSettings,
}


# (section, key) -> (check, the allowed values as a user reads them)
def _networks(text: str) -> bool:
    try:
        networks(text)
    except ValueError:
        return False
    return True


MAX_STEPS = 10_000_000
MAX_SEED = 2**63 - 1  # numpy's generators take any; SQLite and JSON readers take this much
RULES: dict[tuple[str, str], tuple[Any, str]] = {
    ("model", "name"): (lambda v: v in MODELS, " or ".join(MODELS)),
    ("model", "layers"): (lambda v: 1 <= v <= 48, "an integer from 1 to 48"),
    ("model", "width"): (lambda v: 8 <= v <= 4096, "an integer from 8 to 4096"),
    ("model", "heads"): (lambda v: 1 <= v <= 64, "an integer from 1 to 64"),
    ("model", "context"): (lambda v: 2 <= v <= 4096, "an integer from 2 to 4096"),
    ("corpus", "source"): (lambda v: bool(v), '"python-stdlib" or a path to text'),
    ("corpus", "max_mb"): (lambda v: 1 <= v <= 4096, "an integer from 1 to 4096"),
    ("corpus", "validation_share"): (lambda v: 0 < v < 0.5, "a number between 0 and 0.5"),
    ("training", "steps"): (lambda v: 1 <= v <= MAX_STEPS, "an integer from 1 to 10,000,000"),
    ("training", "batch_size"): (lambda v: 1 <= v <= 65536, "an integer from 1 to 65536"),
    ("training", "seed"): (lambda v: 0 <= v <= MAX_SEED, "an integer from 0 to 2**63 - 1"),
    ("training", "checkpoint_every"): (lambda v: v >= 1, "a positive integer"),
    ("training", "eval_every"): (lambda v: v >= 1, "a positive integer"),
    ("training", "micro_batches"): (lambda v: 1 <= v <= 64, "an integer from 1 to 64"),
    ("optimizer", "lr"): (lambda v: 0 < v <= 10, "a number in (0, 10]"),
    ("optimizer", "min_lr"): (lambda v: 0 <= v <= 10, "a number in [0, 10]"),
    ("optimizer", "warmup_steps"): (lambda v: v >= 0, "a non-negative integer"),
    ("optimizer", "beta1"): (lambda v: 0 <= v < 1, "a number in [0, 1)"),
    ("optimizer", "beta2"): (lambda v: 0 <= v < 1, "a number in [0, 1)"),
    ("optimizer", "eps"): (lambda v: 0 < v < 1, "a number in (0, 1)"),
    ("optimizer", "weight_decay"): (lambda v: 0 <= v < 1, "a number in [0, 1)"),
    ("optimizer", "grad_clip"): (lambda v: v >= 0, "a non-negative number (0: no clipping)"),
    ("work", "tile"): (lambda v: 1 <= v <= 4096, "an integer from 1 to 4096"),
    ("work", "sizing"): (lambda v: v in ("crowd", "fixed"), '"crowd" or "fixed"'),
    ("work", "policy"): (lambda v: v in {p.value for p in Policy}, "quorum, freivalds or both"),
    ("work", "freivalds_rounds"): (lambda v: 1 <= v <= 64, "an integer from 1 to 64"),
    ("work", "target_nresults"): (lambda v: 1 <= v <= 16, "an integer from 1 to 16"),
    ("work", "min_quorum"): (lambda v: 1 <= v <= 16, "an integer from 1 to 16"),
    ("work", "max_error_results"): (lambda v: 0 <= v <= 1000, "an integer from 0 to 1000"),
    ("work", "max_total_results"): (lambda v: 1 <= v <= 1000, "an integer from 1 to 1000"),
    ("work", "delay_bound"): (lambda v: 0.1 <= v <= 1e6, "seconds, from 0.1 to 1e6"),
    ("work", "adaptive_replication"): (lambda v: isinstance(v, bool), "true or false"),
    ("access", "invite_code"): (lambda v: len(v) <= 256, "a string of at most 256 characters"),
    ("access", "host_rate"): (lambda v: 0.1 <= v <= 1e6, "requests per second, 0.1 to 1e6"),
    ("access", "registrations_per_hour"): (lambda v: 1 <= v <= 1e9, "a positive integer"),
    ("access", "trusted_proxies"): (
        _networks,
        'addresses or networks, comma-separated (e.g. "127.0.0.1, 10.0.0.0/8")',
    ),
}


def _section(name: str, cls: type, values: Any) -> Any:
    if not isinstance(values, dict):
        raise ProjectError(f"[{name}] must be a table")
    known = {f.name: f for f in dataclasses.fields(cls)}
    for key in values:
        if key not in known:
            raise ProjectError(
                f"unknown setting {name}.{key}; the [{name}] settings are {', '.join(known)}"
            )
    settings = {}
    for key, value in values.items():
        default = known[key].default
        if isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if type(value) is not type(default):
            raise ProjectError(
                f"{name}.{key} must be {type(default).__name__}, got {value!r}; allowed: "
                f"{RULES[(name, key)][1]}"
            )
        check, allowed = RULES[(name, key)]
        if not check(value):
            raise ProjectError(f"{name}.{key} = {value!r} is not allowed; use {allowed}")
        settings[key] = value
    return cls(**settings)


def parse(directory: Path, text: str) -> Project:
    """A Project from project.toml text; ProjectError names the key and the allowed values."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ProjectError(f"{directory / PROJECT_FILE} is not valid TOML: {exc}") from exc
    for name in data:
        if name not in SECTIONS:
            raise ProjectError(f"unknown section [{name}]; sections are {', '.join(SECTIONS)}")
    parts = {name: _section(name, cls, data.get(name, {})) for name, cls in SECTIONS.items()}
    project = Project(directory=directory, **parts)
    model, work, opt = project.model, project.work, project.optimizer
    if model.width % model.heads:
        raise ProjectError(
            f"model.width ({model.width}) must be a multiple of model.heads ({model.heads})"
        )
    if project.training.batch_size % project.training.micro_batches:
        raise ProjectError(
            f"training.batch_size ({project.training.batch_size}) must be a multiple of "
            f"training.micro_batches ({project.training.micro_batches})"
        )
    if work.min_quorum > work.target_nresults:
        raise ProjectError("work.min_quorum must not exceed work.target_nresults")
    if opt.min_lr > opt.lr:
        raise ProjectError("optimizer.min_lr must not exceed optimizer.lr")
    return project


def load(directory: Path | str) -> Project:
    directory = Path(directory)
    path = directory / PROJECT_FILE
    try:
        text = path.read_text()
    except FileNotFoundError as exc:
        traces = leftover_state(directory)
        if traces:
            # `init` refuses such a folder (a new project would resume from its state):
            # pointing there sent the operator round in a circle.
            raise ProjectError(
                f"{path} not found, but {directory} holds a project's state "
                f"({', '.join(traces)}): put its project.toml back (from a backup, or write "
                "one with the settings it was trained with: `tilehive init` in another "
                "folder writes the defaults to copy and edit)"
            ) from exc
        raise ProjectError(
            f"{path} not found: create a project with `tilehive init {directory}`"
        ) from exc
    except UnicodeDecodeError as exc:
        raise ProjectError(f"{path} is not UTF-8 text, as TOML must be ({exc.reason})") from None
    try:
        return parse(directory, text)
    except ProjectError as exc:
        said = str(exc)
        if PROJECT_FILE in said:
            raise
        raise ProjectError(f"{path}: {said}") from exc  # every command names the file


TEMPLATE = """\
# A tilehive project: one training run in this directory.
# `tilehive coordinator DIR` trains it with volunteers; `tilehive train DIR --local` trains the
# same model in one process, and both write bit-identical checkpoints/step-NNNNNN.npz.

[model]
name = "{model.name}"          # the only model so far: a decoder-only transformer on bytes
layers = {model.layers}                # transformer blocks
width = {model.width}               # embedding width (a multiple of heads)
heads = {model.heads}                 # attention heads
context = {model.context}              # tokens (bytes) per sequence

[corpus]
source = "{corpus.source}"  # "python-stdlib": the running Python's own .py files; or a path
max_mb = {corpus.max_mb}                # read at most this much text
validation_share = {corpus.validation_share}    # held out to validate: whole files, or files' ends

[training]
steps = {training.steps}                 # optimizer steps; warmup and decay of the rate span them
batch_size = {training.batch_size}           # sequences per step
seed = {training.seed}                  # initial weights and batch order
checkpoint_every = {training.checkpoint_every}     # steps between checkpoints (and the last step)
eval_every = {training.eval_every}           # steps between validation losses
micro_batches = {training.micro_batches}        # the batch in this many parts, in flight together

[optimizer]                 # AdamW with gradient clipping, warmup then cosine decay
lr = {optimizer.lr}
min_lr = {optimizer.min_lr}
warmup_steps = {optimizer.warmup_steps}
beta1 = {optimizer.beta1}
beta2 = {optimizer.beta2}
eps = {optimizer.eps}
weight_decay = {optimizer.weight_decay}
grad_clip = {optimizer.grad_clip}            # max global gradient norm; 0 turns clipping off

[work]                      # how matrix products become work units
tile = {work.tile}                # output tile size (rows and columns); "crowd" starts from it
sizing = "{work.sizing}"          # crowd: each product's tile is `tile` times a power of two
                              # (from half of it to the whole product), from the hosts' number,
                              # speed and what a tile costs them beyond its arithmetic; fixed:
                              # always `tile`.
                              # The kernel is tiling-invariant: the bits are the same either way.
policy = "{work.policy}"          # quorum: bit-identical hashes; freivalds: a keyed check; both
freivalds_rounds = {work.freivalds_rounds}     # a wrong tile passes with probability <= 2^-rounds
target_nresults = {work.target_nresults}       # replicas issued per work unit (quorum policies)
min_quorum = {work.min_quorum}            # identical results needed
max_error_results = {work.max_error_results}     # client errors + invalid results before it fails
max_total_results = {work.max_total_results}     # results of any kind, timeouts too
delay_bound = {work.delay_bound}         # seconds a volunteer has for one tile
adaptive_replication = {adaptive}  # false: every tile gets its quorum, bitwise even against
                              # a trusted host that turns liar; true: trusted hosts may get
                              # tiles alone, Freivalds-checked (less compute, but a lie below
                              # the check's tolerance then passes: docs/security.md)

[access]                    # who may join, how often; the admin token is in admin.token
invite_code = "{access.invite_code}"          # non-empty: volunteers must register with it
host_rate = {access.host_rate}           # requests per second one host may make (bursts of 2x;
                              # each result it is given earns it one more, to report it)
registrations_per_hour = {access.registrations_per_hour}   # registrations per client address
trusted_proxies = "{access.trusted_proxies}"      # reverse proxies (e.g. "127.0.0.1") whose
                              # X-Forwarded-For names the client: limits and logs use it
"""


def render(project: Project) -> str:
    return TEMPLATE.format(
        model=project.model,
        corpus=project.corpus,
        training=project.training,
        optimizer=project.optimizer,
        work=project.work,
        access=project.access,
        adaptive="true" if project.work.adaptive_replication else "false",
    )


def leftover_state(directory: Path) -> list[str]:
    """What of a project's state a folder holds without its project.toml: the state
    database, the steps' history, checkpoints."""
    found = [name for name in ("state.db", "train.jsonl") if (directory / name).is_file()]
    checkpoints = directory / "checkpoints"
    if checkpoints.is_dir() and any(checkpoints.glob("step-*.npz")):
        found.append("checkpoints/")
    return found


def create(directory: Path | str, **overrides: Any) -> Project:
    """Write a new project.toml with documented defaults (overrides: section.key=value)."""
    directory = Path(directory)
    path = directory / PROJECT_FILE
    if path.exists():
        raise ProjectError(f"{path} exists already; refusing to overwrite a project")
    traces = leftover_state(directory)
    if traces:
        raise ProjectError(
            f"{directory} holds a project's state without its project.toml "
            f"({', '.join(traces)}): a new project there would resume from it; to go on "
            "with that project put its project.toml back, else choose an empty folder or "
            "move those away"
        )
    project = Project(directory=directory)
    for dotted, value in overrides.items():
        section, key = dotted.split(".")
        part = dataclasses.replace(getattr(project, section), **{key: value})
        project = dataclasses.replace(project, **{section: part})
    text = render(project)
    parse(directory, text)  # the same checks as loading it later
    try:
        directory.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        admin_token(directory)  # made now, so the operator can read it before the first start
    except OSError as exc:  # a file where a folder should be, no permission, a full disk
        with contextlib.suppress(OSError):
            path.unlink()  # no half-written project.toml to refuse the next try
        raise ProjectError(
            f"cannot create {exc.filename or directory}: {exc.strerror or exc}"
        ) from None
    return project
