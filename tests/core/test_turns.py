"""Turns (core/turns.py): work that awaits on its way goes on in the order it took its turns;
a turn stuck longer than max_wait_s lets the later ones go; every turn is done once."""

from __future__ import annotations

import asyncio

from halfmoon.core.turns import Turns


async def ordered_run(turns: Turns, delays: list[float], stuck: int | None = None) -> list[int]:
    """Each worker takes a turn, awaits its delay (answers out of order), then waits its turn
    and records itself; `stuck` never finishes its await (cancelled at the end)."""
    went: list[int] = []
    gates = {i: asyncio.Event() for i in range(len(delays))}

    async def work(i: int, turn: int) -> None:
        try:
            if i == stuck:
                await asyncio.Event().wait()
            await asyncio.wait_for(gates[i].wait(), 5.0)
            await turns.wait(turn)
            went.append(i)
        finally:
            turns.done(turn)

    tasks = [asyncio.create_task(work(i, turns.take())) for i in range(len(delays))]
    for i in sorted(range(len(delays)), key=lambda i: delays[i]):  # the answers come back in this order
        gates[i].set()
        await asyncio.sleep(0)  # let the answered one run up to its wait (yield to the loop)
    await asyncio.wait([t for i, t in enumerate(tasks) if i != stuck], timeout=5.0)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return went


def test_answers_out_of_order_go_on_in_turn_order() -> None:
    turns = Turns()
    assert asyncio.run(ordered_run(turns, [0.3, 0.1, 0.2, 0.0])) == [0, 1, 2, 3]
    assert turns.outstanding == 0


def test_a_stuck_turn_holds_the_later_ones_only_max_wait_s() -> None:
    turns = Turns(max_wait_s=0.05)
    went = asyncio.run(ordered_run(turns, [0.0, 0.1, 0.2], stuck=0))
    assert sorted(went) == [1, 2] and turns.outstanding == 0


def test_done_is_idempotent_and_out_of_order_dones_advance_together() -> None:
    turns = Turns()
    a, b, c = turns.take(), turns.take(), turns.take()
    turns.done(c)
    turns.done(b)
    assert turns.outstanding == 1  # a still runs
    turns.done(a)
    turns.done(a)
    assert turns.outstanding == 0 and turns.take() == 3
