"""Name and alias claims (KV `fbx_names`) at the catalog store, against a real nats-server."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace

import nats
import pytest
from nats.aio.client import Client as NATS
from nats.js.errors import BucketNotFoundError, KeyNotFoundError

from appliance import bus
from appliance.catalog import Catalog, ModelChange, ModelSpec
from appliance.catalog_store import CatalogStore
from appliance.configured import spec_from_entry
from appliance.errors import Conflict
from appliance.names import NameClaims
from appliance.natsd import EmbeddedNats
from appliance.registration import refuse_taken
from appliance.settings import Settings
from appliance.tasks import cancel_and_wait
from tests.conftest import hold, noop_model, wait_for


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


async def entry_of(store: CatalogStore, name: str) -> ModelSpec | None:
    """The model as the bucket holds it now (None when gone)."""
    try:
        entry = await store._kv.get(spec(name).slug)
    except KeyNotFoundError:
        return None
    return ModelSpec.from_json(entry.value) if entry.value else None


async def claim_holder(nc: NATS, name: str) -> str | None:
    names = await nc.jetstream().key_value(bus.NAMES_BUCKET)
    try:
        return (await names.get(bus.name_key(name))).value.decode()
    except KeyNotFoundError:
        return None


async def claim_elsewhere(nc: NATS, owner: str, *names: str) -> None:
    """What a registration of `owner` on a box whose catalog shows none of `names` taken does: claim them."""
    claims = NameClaims(nc.jetstream())
    await claims.open()
    await claims.claim(owner, names)


@pytest.fixture
async def two_boxes(nats_server: EmbeddedNats) -> AsyncIterator[tuple[NATS, CatalogStore, CatalogStore]]:
    """Two boxes' catalog stores on one fleet, and the first one's connection (to look at the claims)."""
    made = await stores(nats_server, 2)
    yield made[0][0], made[0][1], made[1][1]
    for client, store in made:
        await store.close()
        await client.close()


async def registered(first: CatalogStore, second: CatalogStore, model: ModelSpec) -> None:
    """`model` registered on the first box, and heard of on the second."""
    await first.create(model)
    await wait_for(lambda: second.catalog.get(model.name) == model, what="the second box to see the model")


async def test_an_alias_dropped_and_taken_elsewhere_meanwhile_is_not_written_back_by_a_change_that_kept_it(
    two_boxes: tuple[NATS, CatalogStore, CatalogStore],
) -> None:
    """Box b changes a's aliases from [x] to [x, y] and is held at its write. Meanwhile box a drops x from a, and
    c registers with alias x. b's write, made again over a's, used to put x back unclaimed: x on two models for
    good (found by review)."""
    nc, first, second = two_boxes
    await registered(first, second, spec("a", "x"))
    reached, go_on = hold(second._kv, "update")
    keeping = asyncio.create_task(second.update(second.catalog.get("a"), ModelChange(aliases=("x", "y"))))
    await asyncio.wait_for(reached.wait(), 10)
    await first.update(first.catalog.get("a"), ModelChange(aliases=()))
    await first.create(spec("c", "x"))
    go_on.set()
    with pytest.raises(Conflict, match="alias 'x' is taken by model 'c'"):
        await keeping
    assert (await entry_of(first, "a")).aliases == ()
    assert (await entry_of(first, "c")).aliases == ("x",)
    assert await claim_holder(nc, "y") is None  # the refused change's new alias given back


async def test_a_dropped_aliass_claim_renewed_by_a_change_that_put_it_back_is_kept(
    two_boxes: tuple[NATS, CatalogStore, CatalogStore],
) -> None:
    """Box a drops x from a and is held after its write, before it gives x's claim back; box b puts x back (with
    x2). a's give-back used to free x's claim while the model lists x: a box whose catalog has not heard of b's
    change could then register x for another model (found by review)."""
    nc, first, second = two_boxes
    await registered(first, second, spec("a", "x"))
    reached, go_on = hold(first._kv, "update", after=True)
    dropping = asyncio.create_task(first.update(first.catalog.get("a"), ModelChange(aliases=())))
    await asyncio.wait_for(reached.wait(), 10)
    await second.update(second.catalog.get("a"), ModelChange(aliases=("x", "x2")))
    go_on.set()
    await dropping
    assert (await entry_of(first, "a")).aliases == ("x", "x2")
    assert await claim_holder(nc, "x") == "a"
    with pytest.raises(Conflict, match="alias 'x' is taken by model 'a'"):
        await claim_elsewhere(nc, "c", "x")  # a registration on a box that has not heard of b's change


async def test_a_change_claims_its_new_aliases_against_a_box_that_has_not_heard_of_it(
    two_boxes: tuple[NATS, CatalogStore, CatalogStore],
) -> None:
    """Box b's watch is late: it judges a registration of alias y as free after a's change gave y to a. The change's
    claim on y is what refuses it."""
    _, first, second = two_boxes
    await registered(first, second, spec("a"))
    await cancel_and_wait([second._task])  # b hears nothing from here on
    await first.update(first.catalog.get("a"), ModelChange(aliases=("y",)))
    assert second.catalog.get("y") is None
    with pytest.raises(Conflict, match="alias 'y' is taken by model 'a'"):
        await second.create(spec("c", "y"))


async def test_an_alias_a_change_dropped_is_free_at_once_on_a_box_that_has_not_heard_of_it(
    two_boxes: tuple[NATS, CatalogStore, CatalogStore],
) -> None:
    """Box b's watch is late: its catalog still shows x on a after a's change dropped it. Its look in the bucket
    finds a without x, and a registration of x is not refused (it was, for as long as b's watch lagged: found by
    review)."""
    _, first, second = two_boxes
    await registered(first, second, spec("a", "x"))
    await cancel_and_wait([second._task])
    await first.update(first.catalog.get("a"), ModelChange(aliases=()))
    await refuse_taken(("x",), second.catalog, second)
    await second.create(spec("c", "x"))
    with pytest.raises(Conflict, match="'x' is taken: model 'c' has it as an alias"):
        await refuse_taken(("x",), second.catalog, second)


async def test_deleting_a_model_frees_its_own_name_at_once(nc: NATS) -> None:
    """The name as well as the aliases: another model may take the deleted one's name as its alias at once."""
    store = CatalogStore(nc.jetstream(), Catalog(), registers=True)
    await store.open([])
    await store.create(spec("z", "zed"))
    await store.delete(store.catalog.get("z"))
    await claim_elsewhere(nc, "other", "z", "zed")
    await store.close()


async def test_a_change_racing_a_delete_leaves_no_claim_of_the_deleted_model(
    two_boxes: tuple[NATS, CatalogStore, CatalogStore],
) -> None:
    """Box a deletes m and is held after giving back m's claims, before the deletion; box b gives m alias y
    meanwhile. The deletion used to remove m without looking: y stayed claimed
    by a deleted model for `CLAIM_TTL_S` (found by review)."""
    nc, first, second = two_boxes
    await registered(first, second, spec("m"))
    reached, go_on = hold(first._kv, "delete")
    deleting = asyncio.create_task(first.delete(first.catalog.get("m")))
    await asyncio.wait_for(reached.wait(), 10)
    await second.update(second.catalog.get("m"), ModelChange(aliases=("y",)))
    go_on.set()
    await deleting
    assert await entry_of(first, "m") is None and first.catalog.get("m") is None
    await claim_elsewhere(nc, "c", "y", "m")


async def test_a_claim_its_holder_does_not_list_is_refused_as_in_flight_not_as_taken(
    two_boxes: tuple[NATS, CatalogStore, CatalogStore],
) -> None:
    """Tester h89: changes of one model's aliases racing each other left a claim on an alias the model did not have
    (to the claims' TTL), and a registration of it was told "taken by model 'a' as an alias ...; delete it first",
    where a had no such alias (or no longer existed). The refusal says a change of a holds it, in flight or cut
    short; an alias a has is still "taken"."""
    nc, first, second = two_boxes
    await registered(first, second, spec("a", "y"))
    await claim_elsewhere(nc, "a", "x")  # a change of a in flight, or one cut short: a does not list x
    with pytest.raises(Conflict, match="'x' is being taken by a registration or change of model 'a', in flight or cut"):
        await second.create(spec("c", "x"))
    with pytest.raises(Conflict, match="alias 'y' is taken by model 'a' as an alias"):
        await second.create(spec("d", "y"))
    with pytest.raises(Conflict, match="'z' is being taken by a registration or change of model 'gone'"):
        await claim_elsewhere(nc, "gone", "z")
        await second.create(spec("e", "z"))
