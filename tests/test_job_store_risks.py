"""Redis settings that would lose jobs without an error (an eviction policy other than noeviction, appendonly off):
named by the store, warned of by each job consumer as they appear, and exported as batchasr_job_store_risk."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace

import pytest

from models import load_model
from service.config import Settings
from service.job_keys import INPUTS_KEY, JOB_KEY, UPLOAD_KEY
from service.job_types import ItemInput
from service.jobs import JobStore
from service.metrics import JOB_STORE_RISKS
from service.runtime import build_stack
from tests.redis_server import RedisServer

NO_RISK = dict.fromkeys(JOB_STORE_RISKS, 0)


@pytest.fixture
def durable_redis(tmp_path):
    """A Redis as docs/jobs.md asks for: appendonly yes, noeviction (its default)."""
    server = RedisServer(tmp_path, appendonly=True).start()
    yield server
    server.stop()


def _upload(n_bytes: int, name: str) -> ItemInput:
    return ItemInput(audio=name, upload=bytes(n_bytes))


def test_the_store_names_each_risk_and_why(durable_redis):
    client = durable_redis.client()

    async def risks() -> dict[str, str]:
        store = JobStore.from_url(durable_redis.url)
        try:
            return await store.durability_risks()
        finally:
            await store.close()

    assert asyncio.run(risks()) == {}
    client.config_set("maxmemory-policy", "volatile-lru")
    found = asyncio.run(risks())
    assert list(found) == ["eviction"] and "maxmemory-policy is volatile-lru" in found["eviction"]
    client.config_set("appendonly", "no")
    found = asyncio.run(risks())
    assert set(found) == {"eviction", "no_appendonly"} <= set(JOB_STORE_RISKS)
    assert "Set appendonly yes" in found["no_appendonly"]


def test_a_volatile_eviction_policy_does_lose_jobs(durable_redis):
    """Why eviction is a risk even for volatile-* policies: every key of a job has a TTL. A full Redis made room for
    a new job by evicting keys of the jobs it held (which ones, LRU's sampling picks), and told no one."""
    client = durable_redis.client()
    client.config_set("maxmemory-policy", "volatile-lru")

    async def scenario() -> None:
        store = JobStore.from_url(durable_redis.url)
        try:
            first, _ = await store.submit([_upload(2 << 20, "a.wav")])
            client.config_set("maxmemory", client.info("memory")["used_memory"] + (1 << 20))
            second, _ = await store.submit([_upload(2 << 20, "b.wav")])  # accepted: no error, room was made
            assert client.info("stats")["evicted_keys"] >= 1
            keys = [template.format(job_id=job.id, index=0) for job in (first, second)
                    for template in (JOB_KEY, INPUTS_KEY, UPLOAD_KEY)]
            assert client.exists(*keys) < len(keys)  # a job lost its record, its inputs or its audio
        finally:
            await store.close()

    asyncio.run(scenario())


def test_a_consumer_warns_of_each_risk_once_as_it_appears_and_exports_them(durable_redis, parity_dir, caplog):
    client = durable_redis.client()
    model = load_model(parity_dir / "tdt.nemo", device="cpu", dtype="float32")

    def exported() -> dict[str, float]:
        return {risk: stack.metrics.job_store_risk.labels(risk)._value.get() for risk in JOB_STORE_RISKS}

    async def wait_for(condition, what: str) -> None:
        for _ in range(100):
            if condition():
                return
            await asyncio.sleep(0.05)
        raise AssertionError(what)

    async def scenario() -> None:
        consumer = stack.make_consumer()
        consumer.options = replace(consumer.options, store_check_interval_s=0.1, block_ms=50)
        stop = asyncio.Event()
        task = asyncio.create_task(consumer.run(stop))
        try:
            await asyncio.sleep(0.5)  # several checks of a Redis as it should be
            assert exported() == NO_RISK
            client.config_set("maxmemory-policy", "allkeys-lru")
            await wait_for(lambda: exported()["eviction"] == 1, "eviction not exported")
            client.config_set("appendonly", "no")
            both = {**NO_RISK, "eviction": 1, "no_appendonly": 1}
            await wait_for(lambda: exported() == both, "no_appendonly not exported")
            await asyncio.sleep(0.5)  # checked again and again: warned of once each
            client.config_set("maxmemory-policy", "noeviction")
            client.config_set("appendonly", "yes")
            await wait_for(lambda: exported() == NO_RISK, "risks not cleared")
        finally:
            stop.set()
            await task
            await stack.stop()

    stack = build_stack(Settings(redis_url=durable_redis.url), model)
    with caplog.at_level(logging.INFO, logger="service.job_worker"):
        asyncio.run(scenario())
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "at risk" in r.getMessage()]
    assert len(warnings) == 2, warnings
    assert "maxmemory-policy is allkeys-lru" in warnings[0] and "appendonly off" in warnings[1]
    cleared = [r.getMessage() for r in caplog.records if "no longer at risk" in r.getMessage()]
    assert sorted(cleared) == ["jobs no longer at risk (eviction): Redis's setting changed",
                               "jobs no longer at risk (no_appendonly): Redis's setting changed"]


def test_a_redis_that_refuses_info_is_said_once_and_nothing_is_exported_as_a_risk(durable_redis, parity_dir, caplog):
    """An ACL (or a proxy) may refuse INFO: nothing can be said of the settings then, and the consumer says so once,
    not at every look, and goes on."""
    client = durable_redis.client()
    client.acl_setuser("jobs", enabled=True, passwords=["+secret"], keys=["*"], channels=["*"],
                       commands=["+@all", "-info"])
    url = f"redis://jobs:secret@127.0.0.1:{durable_redis.port}/0"
    model = load_model(parity_dir / "tdt.nemo", device="cpu", dtype="float32")

    async def scenario() -> None:
        store = JobStore.from_url(url)
        assert await store.durability_risks() is None
        await store.close()
        stack = build_stack(Settings(redis_url=url), model)
        consumer = stack.make_consumer()
        consumer.options = replace(consumer.options, store_check_interval_s=0.05, block_ms=50)
        stop = asyncio.Event()
        task = asyncio.create_task(consumer.run(stop))
        await asyncio.sleep(0.6)  # a dozen looks
        assert stack.metrics.job_store_risk.labels("eviction")._value.get() == 0
        stop.set()
        await task
        await stack.stop()

    with caplog.at_level(logging.INFO, logger="service.job_worker"):
        asyncio.run(scenario())
    said = [r for r in caplog.records if "cannot read Redis's settings" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.INFO
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
