"""Which registration holds each model name and alias in the fleet: claims that make taking one atomic.

A model is written to `fbx_models` under its slug with `kv.create`, so two registrations of one slug
cannot both succeed. But names and aliases share one namespace (a request's `model` is looked up among
both) that no slug covers: two registrations may both claim the alias `x`, or one the name `x` and the
other the alias `x`, at one moment on two boxes, each checking a catalog the other's write has not yet
reached. So before its catalog write a registration claims its name and each alias in KV bucket
`fbx_names` (key: `bus.name_key(name)`, exact, as the catalog compares names; value: the registering
model's name) with `kv.create`, in one order (sorted) on every box: of two registrations of different
models wanting one name, exactly one gets it, and the other is refused 409 having given back what it
had claimed.

A claim only has to last until every box's catalog shows its model (a watch: milliseconds). From then
on each box's own catalog refuses the name, as it always did. So claims lapse with the bucket's TTL
(`CLAIM_TTL_S`), and one that a registration cut short leaves behind (its box died between claim and
catalog write) frees itself. A registration refused for its slug, and a model's deletion (just before
the model goes), give their claims back at once, so the name is free again without waiting for the
TTL. A registration that failed otherwise keeps them (its model may have landed), and its retry takes
them over: a claim held by the same model name is that model's own, and two registrations of one name
are settled by the slug. A claim taken over is never given back by the taker: the registration it was
taken from may be the one that lands.

A change of a model's aliases (`CatalogStore.update`) claims its whole new list on each try, after reading
the entry it writes over, so an alias the model had when the change was judged, dropped and claimed by
another model since, is refused rather than written back. The aliases it drops are given back after its
write only at the revisions read before it: a claim renewed meanwhile belongs to a change that put it back.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, StorageType
from nats.js.errors import BadRequestError, KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from appliance import bus
from appliance.errors import Conflict

log = logging.getLogger(__name__)

# Far longer than a registration takes from claim to catalog write and its watch reaching every box
# (a box cut off from NATS that long re-reads the whole catalog when it is back); short enough that a
# claim left by a box that died mid-registration does not keep its names for long.
CLAIM_TTL_S = 300.0
_TRIES = 3  # a claim whose holder keeps changing under it: refused after this many looks
_WRONG_LAST_SEQUENCE = 10071  # JetStream's error code when a conditional write finds a newer revision


@dataclass(slots=True, frozen=True)
class Claim:
    """A name this registration took, at the revision it wrote: given back only if still its own.

    One it took over (held under the same model name) may be a landed model's: never given back by
    the taker, whatever becomes of it; it lapses, or the model's deletion releases it.
    """

    name: str
    revision: int
    taken_over: bool = False


class NameClaims:
    """KV bucket `fbx_names`: one short-lived key per name or alias being taken, held by the model taking it."""

    def __init__(
        self,
        js: JetStreamContext,
        *,
        replicas: int = 1,
        lists: Callable[[str, str], Awaitable[bool]] | None = None,
    ) -> None:
        self._js = js
        self._replicas = replicas
        self._kv: KeyValue | None = None
        # Whether a model (first) lists a name (second) as its name or an alias, as the bucket says: a claim its
        # holder does not list is a change in flight, or one cut short whose claim lapses (`_taken` says which).
        self._lists = lists

    async def open(self) -> None:
        """Find or create the bucket: in memory whatever `durable` says, since a claim matters for minutes only."""
        self._kv = await bus.ensure_bucket(
            self._js,
            KeyValueConfig(
                bucket=bus.NAMES_BUCKET, history=1, ttl=CLAIM_TTL_S, replicas=self._replicas, storage=StorageType.MEMORY
            ),
        )

    async def claim(
        self, owner: str, aliases: Iterable[str], *, renewing: Iterable[Claim] = (), own_name: bool = True
    ) -> list[Claim]:
        """Take the model's name and aliases, all or none: 409 `model_exists` naming the first already held.

        `renewing`: claims this caller made on an earlier try (a change written again after another change got
        in first); one still at its revision stays the caller's own (given back should the change fail).
        `own_name` False: the aliases only (a change of a registered model, whose name every catalog holds)."""
        assert self._kv is not None
        earlier = {claim.name: claim for claim in renewing}
        names = {owner, *aliases} if own_name else set(aliases)
        made: list[Claim] = []
        try:
            for name in sorted(names):  # one order everywhere: no two registrations each hold half
                made.append(await self._claim_one(owner, name, earlier.get(name)))
        except BaseException:
            await self.give_back(made)
            raise
        return made

    async def _claim_one(self, owner: str, name: str, earlier: Claim | None = None) -> Claim:
        """One name for `owner`. Held by a registration of the same model name, it is taken over: two
        registrations of one name are settled by the slug's own `kv.create`, and a registration retried
        after a timeout finds its first try's claims still held (kept, since its model may have landed).
        Held at `earlier`'s revision, it is this caller's own claim renewed, not taken over."""
        assert self._kv is not None
        key = bus.name_key(name)
        for _ in range(_TRIES):
            try:
                return Claim(name, await self._kv.create(key, owner.encode()))
            except KeyNotFoundError:
                continue  # the claim in the way lapsed between create's two steps: free now, try again
            except KeyWrongLastSequenceError:
                pass
            try:
                held = await self._kv.get(key)
            except KeyNotFoundError:
                continue  # given back or lapsed since
            if held.value is None or held.value.decode() != owner or held.revision is None:
                raise Conflict(await self._taken(owner, name, held.value), code="model_exists")
            own = earlier is not None and not earlier.taken_over and earlier.revision == held.revision
            try:
                return Claim(name, await self._kv.update(key, owner.encode(), last=held.revision), taken_over=not own)
            except KeyWrongLastSequenceError:
                continue  # changed meanwhile: look again
        raise Conflict(
            f"the name {name!r} keeps changing hands (registrations racing for it); register again",
            code="model_exists",
        )

    async def _taken(self, owner: str, name: str, holder: bytes | None) -> str:
        """The refusal of `owner`'s claim on `name`, naming the model that holds it. One its holder does not list
        is a registration or change of it still in flight, or cut short (changes of one model's aliases racing each
        other leave the claim they took from each other to its TTL): "delete it first" named a model that did not
        exist, or did not have the alias (tester h89)."""
        what = "model name" if name == owner else "alias"
        if not holder:
            return f"{what} {name!r} was being taken by another registration meanwhile; register again"
        holder_name = holder.decode()
        if self._lists is not None and not await self._lists(holder_name, name):
            return (
                f"{what} {name!r} is being taken by a registration or change of model {holder_name!r}, in flight or "
                f"cut short (then free within {CLAIM_TTL_S / 60:.0f} minutes of it); try again shortly"
            )
        held_as = "its name" if holder_name == name else "an alias"
        return f"{what} {name!r} is taken by model {holder_name!r} as {held_as} (registered meanwhile); delete it first"

    async def give_back(self, claims: Iterable[Claim]) -> None:
        """Free names this registration made, each only if nobody else holds it since (the TTL frees the rest)."""
        assert self._kv is not None
        for claim in claims:
            if claim.taken_over:
                continue
            try:
                await self._kv.delete(bus.name_key(claim.name), last=claim.revision)
            except BadRequestError as exc:
                if exc.err_code != _WRONG_LAST_SEQUENCE:
                    log.warning("name claim not given back; it lapses", extra={"claim": claim.name, "error": repr(exc)})
                # else: lapsed already, or taken over by another registration of the same model name
            except NatsError as exc:
                log.warning("name claim not given back; it lapses", extra={"claim": claim.name, "error": repr(exc)})

    async def release(self, owner: str, names: Iterable[str]) -> None:
        """Names `owner` no longer holds (a deleted model's name and aliases), free at once: each claim still
        held by `owner` is given back."""
        await self.give_back(await self.held(owner, names))

    async def held(self, owner: str, names: Iterable[str]) -> list[Claim]:
        """The claims `owner` holds now among `names`, at their revisions: read before a write that drops the
        names, and given back after it, so that one renewed meanwhile (a change racing this one put the name
        back) is not freed under the model listing it."""
        assert self._kv is not None
        held = []
        for name in set(names):
            try:
                entry = await self._kv.get(bus.name_key(name))
            except KeyNotFoundError:
                continue  # lapsed, or never claimed (a model from a config file, or from before claims)
            except NatsError as exc:
                log.warning("name claim not read; it lapses", extra={"claim": name, "error": repr(exc)})
                continue
            if entry.value is not None and entry.value.decode() == owner and entry.revision is not None:
                held.append(Claim(name, entry.revision))
        return held
