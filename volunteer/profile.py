"""Emulated host profiles: groups of hosts whose traits are drawn from distributions (TOML)."""

from __future__ import annotations

import math
import random
import tomllib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

BUILTIN = ("phones", "laptops", "mixed")


class ProfileError(ValueError):
    """A profile file is missing, not TOML, or has a key that is unknown or out of range."""


@dataclass(frozen=True)
class Trait:
    """One per-host trait: its allowed range, its value when a group leaves it out, what it
    means, and whether it is a whole number."""

    low: float
    high: float
    default: float
    meaning: str
    integer: bool = False


# Every key of a [[group]] table but `name` and `share`; each is a number or a distribution.
TRAITS: dict[str, Trait] = {
    "gflops": Trait(0.001, 1e6, 10, "kernel speed in GFLOPS: sets the modelled compute time"),
    "threads": Trait(1, 4096, 1, "cores the host says it has", integer=True),
    "max_memory_mb": Trait(0, 1 << 20, 0, "memory for work in MB, 0: no limit", integer=True),
    "download_mbps": Trait(0.001, 1e6, 1e6, "download bandwidth in megabits per second"),
    "upload_mbps": Trait(0.001, 1e6, 1e6, "upload bandwidth in megabits per second"),
    "latency_ms": Trait(0, 60_000, 0, "round-trip time added to every request, in ms"),
    "session_s": Trait(0.01, 1e9, 1e9, "seconds a host stays online in one session"),
    "offline_s": Trait(0, 1e9, 0, "seconds a host stays away between sessions"),
    "churn": Trait(0, 1, 0, "probability that a host ending a session never returns"),
    "graceful": Trait(0, 1, 1, "probability that a session ends by giving back its work"),
    "error_rate": Trait(0, 1, 0, "probability that a tile is reported as a client error"),
    "lie_rate": Trait(0, 1, 0, "probability that a tile is reported wrong"),
}

# Distribution kind -> its parameters (all numbers but `values`/`weights` of choice).
DISTRIBUTIONS: dict[str, tuple[str, ...]] = {
    "constant": ("value",),
    "uniform": ("low", "high"),
    "lognormal": ("median", "sigma"),
    "normal": ("mean", "sd"),
    "exponential": ("mean",),
    "choice": ("values", "weights"),
}


@dataclass(frozen=True)
class Distribution:
    """A distribution of one trait; draws are clamped into the trait's allowed range."""

    kind: str
    params: tuple[Any, ...]
    trait: Trait

    def draw(self, rng: random.Random) -> float:
        p = self.params
        if self.kind == "constant":
            x = p[0]
        elif self.kind == "uniform":
            x = rng.uniform(p[0], p[1])
        elif self.kind == "lognormal":
            x = p[0] * math.exp(rng.gauss(0.0, p[1]))
        elif self.kind == "normal":
            x = rng.gauss(p[0], p[1])
        elif self.kind == "exponential":
            x = rng.expovariate(1.0 / p[0]) if p[0] > 0 else 0.0
        else:
            x = rng.choices(p[0], weights=p[1])[0]
        x = min(float(self.trait.high), max(float(self.trait.low), float(x)))
        return float(round(x)) if self.trait.integer else x


@dataclass(frozen=True)
class HostTraits:
    """One emulated host, as drawn from its group."""

    group: str
    gflops: float
    threads: int
    max_memory_mb: int
    download_mbps: float
    upload_mbps: float
    latency_ms: float
    session_s: float
    offline_s: float
    churn: float
    graceful: float
    error_rate: float
    lie_rate: float


@dataclass(frozen=True)
class Group:
    name: str
    share: float
    traits: dict[str, Distribution]

    def draw(self, rng: random.Random) -> HostTraits:
        values = {key: dist.draw(rng) for key, dist in self.traits.items()}
        values["threads"] = int(values["threads"])
        values["max_memory_mb"] = int(values["max_memory_mb"])
        return HostTraits(group=self.name, **values)


@dataclass(frozen=True)
class Profile:
    """Where a profile came from, what it says it is, and its groups of hosts."""

    name: str
    description: str
    groups: tuple[Group, ...]
    source: str

    def draw(self, rng: random.Random) -> HostTraits:
        """A new host: its group picked by share, then each trait drawn."""
        group = rng.choices(self.groups, weights=[g.share for g in self.groups])[0]
        return group.draw(rng)


def _number(where: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ProfileError(f"{where} must be a number, got {value!r}")
    return float(value)


def _within(where: str, value: float, trait: Trait) -> float:
    if not trait.low <= value <= trait.high:
        raise ProfileError(
            f"{where} = {value:g} is out of range: {trait.meaning}, from {trait.low:g} to "
            f"{trait.high:g}"
        )
    return value


def _distribution(where: str, value: Any, trait: Trait) -> Distribution:
    if not isinstance(value, dict):
        return Distribution("constant", (_within(where, _number(where, value), trait),), trait)
    kind = value.get("dist")
    if kind not in DISTRIBUTIONS:
        raise ProfileError(
            f"{where}.dist must be one of {', '.join(DISTRIBUTIONS)}, got {kind!r} "
            f'(or give a plain number; e.g. {{ dist = "lognormal", median = 2, sigma = 0.5 }})'
        )
    names = DISTRIBUTIONS[kind]
    for key in value:
        if key != "dist" and key not in names:
            raise ProfileError(
                f"{where}: unknown parameter {key!r} of a {kind} distribution; "
                f"it takes {', '.join(names)}"
            )
    for key in names:
        if key not in value and not (kind == "choice" and key == "weights"):
            raise ProfileError(f"{where}: a {kind} distribution needs {key!r}")
    if kind == "choice":
        values = value["values"]
        if not isinstance(values, list) or not values:
            raise ProfileError(f"{where}.values must be a non-empty list of numbers")
        values = [_within(f"{where}.values", _number(f"{where}.values", v), trait) for v in values]
        weights = value.get("weights", [1.0] * len(values))
        if not isinstance(weights, list) or len(weights) != len(values):
            raise ProfileError(f"{where}.weights must be a list as long as values")
        weights = [_number(f"{where}.weights", w) for w in weights]
        if min(weights) < 0 or sum(weights) <= 0:
            raise ProfileError(f"{where}.weights must be non-negative with a positive sum")
        return Distribution(kind, (values, weights), trait)
    params = tuple(_number(f"{where}.{key}", value[key]) for key in names)
    if kind == "constant":
        _within(f"{where}.value", params[0], trait)
    elif kind == "uniform":
        _within(f"{where}.low", params[0], trait)
        _within(f"{where}.high", params[1], trait)
        if params[0] > params[1]:
            raise ProfileError(f"{where}: low ({params[0]:g}) is above high ({params[1]:g})")
    elif kind in ("lognormal", "normal", "exponential"):
        _within(f"{where}.{names[0]}", params[0], trait)
        if len(params) > 1 and params[1] < 0:
            raise ProfileError(f"{where}.{names[1]} must be >= 0, got {params[1]:g}")
    return Distribution(kind, params, trait)


def _group(where: str, table: Any) -> Group:
    if not isinstance(table, dict):
        raise ProfileError(f"{where} must be a table")
    for key in table:
        if key not in TRAITS and key not in ("name", "share"):
            raise ProfileError(
                f"{where}: unknown key {key!r}; a group has name, share, {', '.join(TRAITS)}"
            )
    name = table.get("name", where)
    if not isinstance(name, str) or not name:
        raise ProfileError(f"{where}.name must be a non-empty string")
    share = _number(f"{where}.share", table.get("share", 1.0))
    if share <= 0:
        raise ProfileError(f"{where}.share must be > 0, got {share:g}")
    traits = {
        key: _distribution(f"{where}.{key}", table.get(key, trait.default), trait)
        for key, trait in TRAITS.items()
    }
    return Group(name, share, traits)


def parse(text: str, source: str = "<profile>") -> Profile:
    """A Profile from TOML text; ProfileError names the key and what is wrong with it."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ProfileError(f"{source} is not valid TOML: {exc}") from exc
    for key in data:
        if key not in ("name", "description", "group"):
            raise ProfileError(
                f"{source}: unknown key {key!r}; a profile has name, description and "
                "[[group]] tables"
            )
    groups = data.get("group")
    if not isinstance(groups, list) or not groups:
        raise ProfileError(f"{source}: no [[group]] of hosts; a profile needs at least one")
    try:
        parsed = tuple(_group(f"group[{i}]", g) for i, g in enumerate(groups))
    except ProfileError as exc:
        raise ProfileError(f"{source}: {exc}") from None
    name = data.get("name", Path(source).stem)
    description = data.get("description", "")
    if not isinstance(name, str) or not isinstance(description, str):
        raise ProfileError(f"{source}: name and description must be strings")
    return Profile(name, description, parsed, source)


def load(spec: str | Path) -> Profile:
    """A built-in profile by name (phones, laptops, mixed) or a profile file by path."""
    if str(spec) in BUILTIN:
        text = resources.files("volunteer").joinpath("profiles", f"{spec}.toml").read_text()
        return parse(text, f"{spec} (built in)")
    path = Path(spec)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ProfileError(
            f"profile {str(spec)!r}: no such file, and not a built-in profile "
            f"({', '.join(BUILTIN)})"
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ProfileError(f"profile {path}: cannot read it: {exc}") from None
    return parse(text, str(path))
