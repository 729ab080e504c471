"""Name and alias claims (KV `fbx_names`) at the catalog store, against a real nats-server."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace

import nats
import pytest
from nats.aio.client import Client as NATS
from nats.js.errors import BucketNotFoundError, KeyNotFoundError

from appliance import bus
from appliance.catalog import Catalog, ModelSpec
from appliance.catalog_store import CatalogStore
from appliance.configured import spec_from_entry
from appliance.errors import Conflict
from appliance.names import NameClaims
from appliance.natsd import EmbeddedNats
from appliance.settings import Settings
from tests.conftest import noop_model


def spec(name: str, *aliases: str) -> ModelSpec:
    return replace(spec_from_entry(noop_model(name, pinned=False), Settings()), aliases=aliases)


@pytest.fixture
async def nc(nats_server: EmbeddedNats) -> AsyncIterator[NATS]:
    client = await nats.connect(nats_server.url)
    yield client
    await client.close()


async def test_a_reader_of_the_catalog_creates_no_claims_bucket(nc: NATS) -> None:
    """The TUI attaches through a reading store: it must not shape the fleet (nor need the rights to)."""
    js = nc.jetstream()
    reader = CatalogStore(js, Catalog())
    await reader.open([])
    with pytest.raises(BucketNotFoundError):
        await js.key_value(bus.NAMES_BUCKET)
    await reader.close()


async def test_deleting_a_model_never_frees_a_claim_taken_after_it_is_gone(nc: NATS) -> None:
    """Box 1 deletes z; the moment z's catalog entry is gone, box 2 registers a new z and claims the name.
    Box 1's release of the old z's claims must not free the new one (a claim holds only the name)."""
    js = nc.jetstream()
    store = CatalogStore(js, Catalog(), registers=True)
    await store.open([])
    old = spec("z", "zed")
    await store.create(old)
    other_box = NameClaims(js)
    await other_box.open()
    catalog_delete = store._kv.delete  # the write that makes the old z gone, fleet-wide

    async def delete_then_new_z_claims(key: str, *args: object, **kwargs: object) -> bool:
        done = await catalog_delete(key, *args, **kwargs)
        await other_box.claim("z", ["zed"])  # box 2, whose catalog no longer holds z
        return done

    store._kv.delete = delete_then_new_z_claims  # type: ignore[method-assign]
    await store.delete(old)
    names = await js.key_value(bus.NAMES_BUCKET)
    for name in ("z", "zed"):
        assert (await names.get(bus.name_key(name))).value == b"z"  # the new z's claims stand
    await store.close()


async def test_a_retried_registration_takes_over_its_own_claims_and_others_are_still_refused(nc: NATS) -> None:
    """A registration that failed after claiming (a timeout: its model may have landed) keeps its claims;
    its retry must not be refused by them for the TTL, while another model still is."""
    claims = NameClaims(nc.jetstream())
    await claims.open()
    first = await claims.claim("a", ["x"])
    again = await claims.claim("a", ["x"])  # the same model name: its own claims
    assert [c.name for c in again] == ["a", "x"]
    assert all(new.revision > old.revision for new, old in zip(again, first, strict=True))
    with pytest.raises(Conflict, match="alias 'x' is taken by model 'a'"):
        await claims.claim("b", ["x"])
    await claims.give_back(first)  # stale revisions: given back by nobody, the retry's claims stand
    kv = await nc.jetstream().key_value(bus.NAMES_BUCKET)
    assert (await kv.get(bus.name_key("x"))).value == b"a"
    await claims.give_back(again)  # taken over: the first try's model may have landed, so they stand
    assert (await kv.get(bus.name_key("x"))).value == b"a"
    await claims.release("a", ["x"])  # its deletion frees them
    with pytest.raises(KeyNotFoundError):
        await kv.get(bus.name_key("x"))


async def stores(nats_server: EmbeddedNats, count: int) -> list[tuple[NATS, CatalogStore]]:
    """`count` boxes' catalog stores on one fleet, each with its own connection."""
    made = []
    for _ in range(count):
        client = await nats.connect(nats_server.url)
        store = CatalogStore(client.jetstream(), Catalog(), registers=True)
        await store.open([])
        made.append((client, store))
    return made


@pytest.mark.parametrize("second_aliases", [("x",), ("y",)])
async def test_a_duplicate_registration_refused_leaves_the_winners_claims(
    nats_server: EmbeddedNats, second_aliases: tuple[str, ...]
) -> None:
    """Box 1 registers a (alias x); box 2, its catalog not showing a yet, registers a again (a client's
    retry elsewhere) and is refused: for the slug, or for alias y held by c. It took a's claims over on
    the way and must not give them back, or box 3 (its check passed before a landed) could register b
    with alias x, or d with alias a: two models answering to one name."""
    (nc1, first), (nc2, second), (nc3, third) = await stores(nats_server, 3)
    try:
        await first.create(spec("c", "y"))
        await first.create(spec("a", "x"))
        with pytest.raises(Conflict):
            await second.create(spec("a", *second_aliases))
        with pytest.raises(Conflict, match="alias 'x' is taken by model 'a'"):
            await third.create(spec("b", "x"))
        with pytest.raises(Conflict, match="alias 'a' is taken by model 'a'"):
            await third.create(spec("d", "a"))
    finally:
        for client, store in ((nc1, first), (nc2, second), (nc3, third)):
            await store.close()
            await client.close()
