"""Keys and limits: per-key concurrency answers 429, /metrics can be protected, keys are never logged."""

from __future__ import annotations

import asyncio
import logging

from tests.conftest import noop_model, url

USER = {"Authorization": "Bearer user-key"}


async def test_too_many_requests_in_flight_for_one_key_is_429(start_box, http) -> None:
    box = await start_box(default_model=False, models=[noop_model(cost_ms=300)], api_keys="user-key",
                          max_concurrent_per_key=2, max_batch_size=1)  # fmt: skip
    results = await asyncio.gather(
        *(
            http.post(url(box, "/v1/embeddings"), json={"model": "noop", "input": f"r{i}"}, headers=USER)
            for i in range(5)
        )
    )
    statuses = sorted(r.status for r in results)
    assert statuses.count(200) >= 2 and 429 in statuses
    limited = next(r for r in results if r.status == 429)
    assert limited.headers["Retry-After"] == "1"
    for response in results:
        response.release()


async def test_metrics_can_require_a_key(start_box, http) -> None:
    box = await start_box(default_model=False, models=[noop_model()], api_keys="user-key", metrics_require_key=True)
    async with http.get(url(box, "/metrics")) as response:
        assert response.status == 401
    async with http.get(url(box, "/metrics"), headers=USER) as response:
        assert response.status == 200
    async with http.get(url(box, "/readyz")) as response:
        assert response.status == 200


async def test_keys_never_reach_the_log(start_box, http, caplog) -> None:
    box = await start_box(default_model=False, models=[noop_model()], api_keys="user-key", admin_keys="admin-key")
    with caplog.at_level(logging.DEBUG):
        for headers in (USER, {"Authorization": "Bearer wrong-key"}, {"Authorization": "Bearer admin-key"}):
            async with http.post(url(box, "/v1/embeddings"), json={"model": "noop", "input": "x"}, headers=headers):
                pass
    assert "user-key" not in caplog.text and "admin-key" not in caplog.text and "wrong-key" not in caplog.text
