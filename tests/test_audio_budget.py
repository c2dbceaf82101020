"""The job consumer's audio budget: how many items may start, as their lengths become known."""

from __future__ import annotations

import asyncio

from service.audio_budget import AudioBudget


def test_items_start_as_their_expected_audio_fits():
    budget = AudioBudget(limit_s=300, expected_item_s=30, max_reading=4)
    assert budget.room(slots=100) == 4  # read at most 4 at once, though 10 would fit
    claims = [budget.claim() for _ in range(4)]
    assert budget.room(100) == 0
    for claim in claims:
        claim.decoded(10.0)  # shorter than expected: the expectation comes down slowly
    assert 10 < budget.expected_item_s < 30 and budget.held_s == 40
    assert budget.room(100) == 4 and budget.room(2) == 2  # the reading limit, then the free slots


def test_a_long_item_raises_the_expectation_at_once_and_runs_alone_past_the_limit():
    budget = AudioBudget(limit_s=100, expected_item_s=5, max_reading=8)
    first = budget.claim()
    first.decoded(3600.0)  # an hour: over the whole budget
    assert budget.expected_item_s == 3600 and budget.room(100) == 0
    first.release()
    first.release()  # once only
    assert budget.held_s == 0 and budget.reading == 0
    assert budget.room(100) == 1  # nothing held: one item starts, however long it may be
    budget.claim()
    assert budget.room(100) == 0


def test_room_is_asked_again_when_an_item_is_decoded_or_finished():
    async def run() -> list[str]:
        budget = AudioBudget(limit_s=60, expected_item_s=30, max_reading=2)
        said: list[str] = []
        claims = [budget.claim(), budget.claim()]
        for step, action in (("decoded", lambda: claims[0].decoded(30)), ("released", claims[1].release)):
            assert budget.room(10) == 0
            waiter = asyncio.ensure_future(budget.changed())
            await asyncio.sleep(0)
            assert not waiter.done()
            action()
            await asyncio.wait_for(waiter, 1)
            said.append(step)
        return said

    assert asyncio.run(run()) == ["decoded", "released"]


def test_without_a_budget_every_free_slot_may_start():
    budget = AudioBudget(limit_s=float("inf"), expected_item_s=30, max_reading=8)
    assert budget.room(slots=5) == 5
    budget.claim().decoded(3600.0)
    assert budget.room(slots=100) == 8  # only the reading limit
