"""WriteBehind (kvpool/write_behind.py): ops applied in order on its own thread, bounded staging
with back-pressure, flush and close, a failing batch skipped without stopping the thread."""

from __future__ import annotations

import threading

import pytest

from halfmoon.kvpool.write_behind import WriteBehind


class Recorder:
    """`apply` that records batches, optionally held at a gate or raising on a marker op."""

    def __init__(self) -> None:
        self.batches: list[list[object]] = []
        self.threads: set[str] = set()
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()

    def __call__(self, ops: list[object]) -> None:
        self.entered.set()
        assert self.gate.wait(10), "gate never opened"
        self.threads.add(threading.current_thread().name)
        if "boom" in ops:
            raise RuntimeError("boom")
        self.batches.append(list(ops))

    @property
    def ops(self) -> list[object]:
        return [op for batch in self.batches for op in batch]


def test_ops_are_applied_in_order_on_the_write_behind_thread() -> None:
    rec = Recorder()
    wb = WriteBehind(rec, name="wb-test")
    for i in range(50):
        wb.submit(i, staged_blocks=i % 2)
    assert wb.flush(10)
    assert rec.ops == list(range(50))
    assert rec.threads == {"wb-test"}
    assert wb.pending() == 0 and wb.stats.applied == 50
    assert wb.close(10)


def test_staging_is_bounded_and_the_submitter_waits_for_room() -> None:
    rec = Recorder()
    rec.gate.clear()
    wb = WriteBehind(rec, max_staged_blocks=2)
    wb.submit("a", staged_blocks=1)
    assert rec.entered.wait(10)  # the thread holds batch ["a"] at the gate: 1 block staged
    wb.submit("b", staged_blocks=1)  # 2 of 2
    done = threading.Event()
    submitter = threading.Thread(target=lambda: (wb.submit("c", staged_blocks=1), done.set()))
    submitter.start()
    assert not done.wait(0.3), "a third staged block went past the bound"
    assert wb.stats.waits == 1
    rec.gate.set()
    assert done.wait(10)
    submitter.join(10)
    assert wb.flush(10) and rec.ops == ["a", "b", "c"]
    wb.close(10)


def test_an_op_larger_than_the_bound_waits_for_an_empty_queue_not_forever() -> None:
    rec = Recorder()
    wb = WriteBehind(rec, max_staged_blocks=2)
    wb.submit("big", staged_blocks=5)
    wb.submit("bigger", staged_blocks=7)
    assert wb.flush(10) and rec.ops == ["big", "bigger"]
    wb.close(10)


def test_a_failing_batch_is_skipped_and_the_thread_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    rec = Recorder()
    rec.gate.clear()
    wb = WriteBehind(rec)
    wb.submit("first")
    assert rec.entered.wait(10)
    wb.submit("boom")  # queued behind the held batch: its own batch
    rec.gate.set()
    assert wb.flush(10)
    wb.submit("after")
    assert wb.flush(10)
    assert rec.ops == ["first", "after"]
    assert wb.stats.failed == 1 and "ops failed" in caplog.text
    wb.close(10)


def test_close_applies_what_is_queued_then_refuses_more() -> None:
    rec = Recorder()
    rec.gate.clear()
    wb = WriteBehind(rec)
    for i in range(3):
        wb.submit(i)
    rec.gate.set()
    assert wb.close(10)
    assert rec.ops == [0, 1, 2]
    with pytest.raises(RuntimeError, match="closed"):
        wb.submit(3)


def test_flush_from_the_thread_itself_does_not_deadlock() -> None:
    results: list[bool] = []
    holder: list[WriteBehind] = []

    def apply(ops: list[object]) -> None:
        results.append(holder[0].flush(1))

    wb = WriteBehind(apply)
    holder.append(wb)
    wb.submit("x")
    assert wb.flush(10)
    assert results == [False]
    wb.close(10)
