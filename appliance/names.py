"""Which registration holds each model name and alias in the fleet: claims that make taking one atomic.

A model is written to `fbx_models` under its slug with `kv.create`, so two registrations of one slug
cannot both succeed. But names and aliases share one namespace (a request's `model` is looked up among
both) that no slug covers: two registrations may both claim the alias `x`, or one the name `x` and the
other the alias `x`, at one moment on two boxes, each checking a catalog the other's write has not yet
reached. So before its catalog write a registration claims its name and each alias in KV bucket
`fbx_names` (key: `bus.name_key(name)`, exact, as the catalog compares names; value: the registering
model's name) with `kv.create`, in one order (sorted) on every box: of two registrations wanting one
name, exactly one gets it, and the other is refused 409 having given back what it had claimed.

A claim only has to last until every box's catalog shows its model (a watch: milliseconds). From then
on each box's own catalog refuses the name, as it always did. So claims lapse with the bucket's TTL
(`CLAIM_TTL_S`), and one that a registration cut short leaves behind (its box died between claim and
catalog write) frees itself. A registration refused after claiming, and a model's deletion, give their
claims back at once, so the name is free again without waiting for the TTL.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, StorageType
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from appliance import bus
from appliance.errors import Conflict

log = logging.getLogger(__name__)

# Far longer than a registration takes from claim to catalog write and its watch reaching every box
# (a box cut off from NATS that long re-reads the whole catalog when it is back); short enough that a
# claim left by a box that died mid-registration does not keep its names for long.
CLAIM_TTL_S = 300.0


@dataclass(slots=True, frozen=True)
class Claim:
    """A name this registration took, at the revision it wrote: given back only if still its own."""

    name: str
    revision: int


class NameClaims:
    """KV bucket `fbx_names`: one short-lived key per name or alias being taken, held by the model taking it."""

    def __init__(self, js: JetStreamContext, *, replicas: int = 1) -> None:
        self._js = js
        self._replicas = replicas
        self._kv: KeyValue | None = None

    async def open(self) -> None:
        """Find or create the bucket: in memory whatever `durable` says, since a claim matters for minutes only."""
        self._kv = await bus.ensure_bucket(
            self._js,
            KeyValueConfig(
                bucket=bus.NAMES_BUCKET, history=1, ttl=CLAIM_TTL_S, replicas=self._replicas, storage=StorageType.MEMORY
            ),
        )

    async def claim(self, owner: str, aliases: Iterable[str]) -> list[Claim]:
        """Take the model's name and aliases, all or none: 409 `model_exists` naming the first already held."""
        assert self._kv is not None
        made: list[Claim] = []
        try:
            for name in sorted({owner, *aliases}):  # one order everywhere: no two registrations each hold half
                try:
                    revision = await self._kv.create(bus.name_key(name), owner.encode())
                except KeyWrongLastSequenceError:
                    raise Conflict(await self._taken(owner, name), code="model_exists") from None
                made.append(Claim(name, revision))
        except BaseException:
            await self.give_back(made)
            raise
        return made

    async def _taken(self, owner: str, name: str) -> str:
        """The refusal of `owner`'s claim on `name`, naming the model that holds it when it can still be read."""
        assert self._kv is not None
        what = "model name" if name == owner else "alias"
        try:
            holder = (await self._kv.get(bus.name_key(name))).value
        except NatsError:  # given back since, or not readable now: the refusal stands all the same
            holder = None
        if not holder:
            return f"{what} {name!r} was being taken by another registration meanwhile; register again"
        holder_name = holder.decode()
        held_as = "its name" if holder_name == name else "an alias"
        return f"{what} {name!r} is taken by model {holder_name!r} as {held_as} (registered meanwhile); delete it first"

    async def give_back(self, claims: Iterable[Claim]) -> None:
        """Free names this registration took, each only if nobody else holds it since (the TTL frees the rest)."""
        assert self._kv is not None
        for claim in claims:
            try:
                await self._kv.delete(bus.name_key(claim.name), last=claim.revision)
            except NatsError as exc:
                log.warning("name claim not given back; it lapses", extra={"name": claim.name, "error": repr(exc)})

    async def release(self, owner: str, aliases: Iterable[str]) -> None:
        """A deleted model's names, free at once: each claim still held by `owner` is given back."""
        assert self._kv is not None
        held = []
        for name in {owner, *aliases}:
            try:
                entry = await self._kv.get(bus.name_key(name))
            except KeyNotFoundError:
                continue  # lapsed, or never claimed (a model from a config file, or from before claims)
            except NatsError as exc:
                log.warning("name claim not read; it lapses", extra={"name": name, "error": repr(exc)})
                continue
            if entry.value is not None and entry.value.decode() == owner and entry.revision is not None:
                held.append(Claim(name, entry.revision))
        await self.give_back(held)
