"""Outputs reach their handlers' queues in order, each event loop woken once per step."""

import asyncio
import types

from kunlun_infer.server.engine_loop import deliver_all


class CountingLoop:
    """An event loop's thread-safe entry: counts wake-ups and runs the callback at once."""

    def __init__(self, closed=False):
        self.wakeups = 0
        self.closed = closed

    def call_soon_threadsafe(self, callback, *args):
        if self.closed:
            raise RuntimeError("Event loop is closed")
        self.wakeups += 1
        callback(*args)


def sub(loop, tag):
    return types.SimpleNamespace(loop=loop, queue=asyncio.Queue(), tag=tag)


def drained(queue):
    return [queue.get_nowait() for _ in range(queue.qsize())]


def test_a_step_of_many_streams_wakes_each_event_loop_once_and_keeps_their_order():
    a, b, gone = CountingLoop(), CountingLoop(), CountingLoop(closed=True)
    subs = [sub(a, "s0"), sub(a, "s1"), sub(b, "s2"), sub(gone, "s3")]
    items = [(subs[0], "x"), (subs[1], "y"), (subs[2], "z"), (subs[0], "x2"), (subs[3], "lost")]
    deliver_all(items)
    assert (a.wakeups, b.wakeups) == (1, 1)  # 5 outputs, 2 live loops: 2 wake-ups
    assert drained(subs[0].queue) == [("s0", "x"), ("s0", "x2")]
    assert drained(subs[1].queue) == [("s1", "y")] and drained(subs[2].queue) == [("s2", "z")]
    assert drained(subs[3].queue) == []  # a closed loop's handler is gone; the others were served
