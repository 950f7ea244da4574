"""Who may do what, how often: the admin token, invite codes, per-host rate limits, and
who a request came from behind a reverse proxy."""

from __future__ import annotations

import hmac
import ipaddress
import os
import secrets
from collections import defaultdict, deque
from dataclasses import dataclass, field
from pathlib import Path

from blake3 import blake3

from coordinator.work.protocol import Forbidden, TooManyRequests, Unauthorized

ADMIN_TOKEN_FILE = "admin.token"


def token_hash(token: str) -> str:
    """What the store keeps of a host's token: its blake3 hash, never the token itself."""
    return blake3(token.encode()).hexdigest()


def admin_token(directory: Path) -> str:
    """The project's admin token: 256 random bits in DIR/admin.token (0600), made once."""
    path = directory / ADMIN_TOKEN_FILE
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32) + "\n")
    return path.read_text().strip()


@dataclass
class TokenBucket:
    """`rate` requests per second on average, bursts of `burst`."""

    rate: float
    burst: float
    tokens: float = -1.0
    stamp: float = 0.0

    def take(self, now: float) -> float:
        """0 if the request may go ahead, else the seconds until it may."""
        if self.tokens < 0:
            self.tokens, self.stamp = self.burst, now
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens >= 1:
            self.tokens -= 1
            return 0.0
        return (1 - self.tokens) / self.rate

    def give(self, tokens: float) -> None:
        """Requests earned beside the rate (a burst's worth at most)."""
        if self.tokens < 0:
            return  # a bucket never taken from is full
        self.tokens = min(self.burst, self.tokens + tokens)


Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def networks(text: str) -> tuple[Network, ...]:
    """The addresses and networks of a comma-separated list ("127.0.0.1, 10.0.0.0/8").
    Raises ValueError naming the first that is neither."""
    found = []
    for item in (part.strip() for part in text.split(",")):
        if item:
            try:
                found.append(ipaddress.ip_network(item, strict=False))
            except ValueError:
                raise ValueError(f"{item!r} is not an address or a network") from None
    return tuple(found)


def client_address(peer: str | None, forwarded: str | None, proxies: tuple[Network, ...]) -> str:
    """The address a request came from: its peer's, or, when the peer is a trusted reverse
    proxy, the last address of X-Forwarded-For that is no trusted proxy's own. Each proxy
    appends the address it heard from, so that one is the client's; whatever stands left
    of it, the client may have written itself."""
    if peer is None or not _within(peer, proxies):
        return peer or "?"
    for hop in reversed((forwarded or "").split(",")):
        hop = hop.strip()
        if not _within(hop, proxies):
            return hop if _is_address(hop) else peer  # junk where an address belongs
    return peer  # proxies all the way: the last one is as near the client as we know


def _is_address(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def _within(address: str, proxies: tuple[Network, ...]) -> bool:
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    return any(ip in network for network in proxies)


@dataclass(frozen=True)
class AccessConfig:
    invite_code: str = ""  # empty: anyone may register
    host_rate: float = 200.0  # requests per second per host, on average
    host_burst: float = 400.0
    registrations_per_hour: int = 30  # per client address
    # Reverse proxies whose X-Forwarded-For names the client: without them, every
    # volunteer behind a proxy has its address, and one registration budget among them.
    trusted_proxies: tuple[Network, ...] = ()


@dataclass
class Access:
    config: AccessConfig
    admin: str
    buckets: dict[int, TokenBucket] = field(default_factory=dict)
    registrations: dict[str, deque] = field(default_factory=lambda: defaultdict(deque))

    def check_admin(self, token: str | None) -> None:
        # Constant time: the admin token guards pausing the project and quarantining hosts.
        if not token:
            raise Unauthorized("admin token required: see DIR/admin.token")
        if not hmac.compare_digest(token.encode(), self.admin.encode()):
            raise Unauthorized("wrong admin token: see DIR/admin.token of this project")

    def check_registration(self, address: str, invite: str | None, now: float) -> None:
        """Refuse a registration beyond the address's hourly budget, or without the invite
        code. Every attempt counts against the budget, a wrong code too: otherwise a
        stranger could guess codes as fast as the coordinator answers."""
        window = self.registrations[address]
        while window and window[0] < now - 3600:
            window.popleft()
        if len(window) >= self.config.registrations_per_hour:
            retry = window[0] + 3600 - now
            raise TooManyRequests(
                f"{len(window)} registrations from {address} in the last hour", retry
            )
        window.append(now)
        code = self.config.invite_code
        if code and not invite:
            raise Forbidden("this project needs an invite code to register (field 'invite')")
        if code and not hmac.compare_digest(invite.encode(), code.encode()):
            raise Forbidden("wrong invite code: ask the project's operator for its code")

    def credit(self, host_id: int, results: int) -> None:
        """The host was given `results` results: it may report each of them beyond its rate
        (up to a burst's worth of requests in hand).

        A volunteer that computes one micro-batch's tile while the coordinator works on the
        other reports a tile at a time, hundreds of times a second on a fast link; those
        requests are the work itself, and only the coordinator decides how much of it a host
        gets. What a host asks of its own accord (asks, heartbeats, blobs beyond its work)
        stays within `host_rate`."""
        bucket = self.buckets.get(host_id)
        if bucket is not None and results > 0:
            bucket.give(results)

    def check_rate(self, host_id: int, now: float) -> None:
        bucket = self.buckets.get(host_id)
        if bucket is None:
            bucket = self.buckets[host_id] = TokenBucket(
                self.config.host_rate, self.config.host_burst
            )
        wait = bucket.take(now)
        if wait:
            raise TooManyRequests(
                f"host {host_id} is over {self.config.host_rate:g} requests per second", wait
            )
