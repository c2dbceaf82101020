"""The intake budget: upload bytes held at once stay within it, requests are let in first come first served, and
nothing leaks when a request fails or goes away."""

from __future__ import annotations

import asyncio

import pytest

from service.intake import IntakeBudget


async def _hold(budget: IntakeBudget, n: int, name: str, log: list[str], release: asyncio.Event) -> None:
    async with budget.hold(n):
        log.append(name)
        await release.wait()


def test_requests_are_let_in_in_turn_within_the_budget():
    async def scenario():
        budget = IntakeBudget(100)
        log: list[str] = []
        releases = {name: asyncio.Event() for name in "abcde"}
        sizes = {"a": 60, "b": 30, "c": 50, "d": 10, "e": 500}  # c waits for room; d, though it fits, waits behind c
        tasks = {}
        for name, size in sizes.items():
            tasks[name] = asyncio.create_task(_hold(budget, size, name, log, releases[name]))
            await asyncio.sleep(0)
        await asyncio.sleep(0.01)
        assert log == ["a", "b"] and budget.held == 90
        releases["a"].set()
        await asyncio.sleep(0.01)
        assert log == ["a", "b", "c", "d"] and budget.held == 90  # c and d fit together once a is done
        releases["b"].set()
        releases["c"].set()
        await asyncio.sleep(0.01)
        assert log == ["a", "b", "c", "d"]  # e, larger than the budget, goes in alone
        releases["d"].set()
        await asyncio.sleep(0.01)
        assert log[-1] == "e" and budget.held == 100
        releases["e"].set()
        await asyncio.gather(*tasks.values())
        assert budget.held == 0 and budget.peak == 100

    asyncio.run(scenario())


def test_a_request_that_fails_or_goes_away_gives_its_room_back():
    async def scenario():
        budget = IntakeBudget(100)
        with pytest.raises(ValueError):
            async with budget.hold(80):
                raise ValueError("undecodable")
        assert budget.held == 0
        log: list[str] = []
        first, never = asyncio.Event(), asyncio.Event()
        holder = asyncio.create_task(_hold(budget, 70, "holder", log, first))
        await asyncio.sleep(0)
        blocked = asyncio.create_task(_hold(budget, 90, "gone", log, never))  # first in line, then the client leaves
        await asyncio.sleep(0)
        small = asyncio.create_task(_hold(budget, 20, "small", log, asyncio.Event()))
        await asyncio.sleep(0.01)
        assert log == ["holder"]
        blocked.cancel()
        await asyncio.sleep(0.01)
        assert log == ["holder", "small"]  # no longer stuck behind the one that left
        small.cancel()
        first.set()
        await asyncio.gather(holder, small, return_exceptions=True)
        assert budget.held == 0

    asyncio.run(scenario())


def test_intake_memory_reports_a_server_that_exits_at_once_with_its_output(tmp_path):
    """loadtest/intake_memory.py gave a server that could not start two minutes, then no reason."""
    import subprocess
    import sys

    from tests.conftest import REPO

    command = [sys.executable, "loadtest/intake_memory.py", "--clients", "1", "--minutes", "0.1", "--model",
               str(tmp_path / "missing.nemo")]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=90)
    assert result.returncode == 1
    assert "the server exited with status" in result.stderr and "missing.nemo" in result.stderr
