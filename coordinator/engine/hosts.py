"""Hosts joining and proving who they are: registration and token authentication."""

from __future__ import annotations

import secrets

from coordinator.rules import trust
from coordinator.rules.access import Access, token_hash
from coordinator.state.ledger import Ledger
from coordinator.work.events import Event
from coordinator.work.protocol import BadRequest, NotFound, RegisterRequest, Unauthorized, loggable
from coordinator.work.records import Host


class HostRegistry:
    """Gives a new host its id and token; maps a bearer token back to its host."""

    def __init__(self, ledger: Ledger, access: Access, trust_config: trust.TrustConfig) -> None:
        self.ledger = ledger
        self.access = access
        self.trust_config = trust_config

    async def register(
        self, request: RegisterRequest, now: float, address: str = "?"
    ) -> tuple[Host, str]:
        self.access.check_registration(address, request.invite, now)
        token = secrets.token_hex(32)
        host_id = max(self.ledger.hosts, default=0) + 1
        host = Host(
            id=host_id,
            name=request.name,
            token_hash=token_hash(token),
            created=now,
            last_contact=now,
            gflops=request.gflops,
            threads=request.threads,
            max_memory_mb=request.max_memory_mb,
        )
        host = host.evolve(max_in_progress=trust.full_quota(host, self.trust_config))
        self.ledger.put_host(host)
        self.ledger.log(
            [Event(now, "host", "registered", f"host {host_id} {request.name!r}", host_id=host_id)]
        )
        await self.ledger.flush()
        return host, token

    def authenticate(self, token: str | None) -> Host:
        if not token:
            raise Unauthorized("missing 'Authorization: Bearer <token>' header")
        host_id = self.ledger.host_by_token.get(token_hash(token))
        if host_id is None:
            raise Unauthorized("unknown token: register again")
        return self.ledger.hosts[host_id]

    def heard_from(self, host_id: int, now: float) -> None:
        """The host is still sending a request (a long body): in contact `now`."""
        host = self.ledger.hosts.get(host_id)
        if host is not None:
            self.ledger.put_host(host.evolve(last_contact=now))

    def find(self, id_or_name: str) -> int:
        """A host's id from its id or its name (the operator's word for it). Raises NotFound,
        or BadRequest when several hosts share the name. Digits alone are always an id: no
        host may take such a name (protocol.parse_register)."""
        if id_or_name.isascii() and id_or_name.isdigit():
            if len(id_or_name) > 18:  # beyond any id; int() of 5,000 digits would raise
                raise NotFound(f"no host {loggable(id_or_name[:20])}...")
            return int(id_or_name)
        named = sorted(h.id for h in self.ledger.hosts.values() if h.name == id_or_name)
        if not named:
            raise NotFound(f"no host named {loggable(id_or_name)}")
        if len(named) > 1:
            ids = ", ".join(map(str, named))
            raise BadRequest(
                f"{len(named)} hosts are named {loggable(id_or_name)}: give the id ({ids})"
            )
        return named[0]
