"""A stand-in for ``torch.cuda``'s API, so device logic is testable without a GPU."""

import contextlib
import types


class FakeCudaApi:
    """Answers like ``torch.cuda`` would on a host with ``count`` devices of compute capability ``major``."""

    def __init__(self, count=2, major=9, total=80 * 2**30, free=70 * 2**30):
        self.count, self.major, self.total, self.free = count, major, total, free
        self.current = None
        self.synced = []
        self.counters = {}

    def is_available(self):
        return self.count > 0

    def device_count(self):
        return self.count

    def set_device(self, index):
        self.current = index

    def synchronize(self, index=None):
        self.synced.append(index)

    def get_device_properties(self, index):
        return types.SimpleNamespace(name="Fake GPU 9000", total_memory=self.total, major=self.major, minor=0,
                                     multi_processor_count=132, uuid="GPU-fake")

    def mem_get_info(self, index):
        return self.free, self.total

    def memory_allocated(self, index):
        return self.counters.get("allocated", 0)

    def memory_reserved(self, index):
        return self.counters.get("reserved", 0)

    def max_memory_allocated(self, index):
        return self.counters.get("peak", 0)

    def memory_stats(self, index):
        return {"allocation.all.allocated": 10, "segment.all.allocated": 3}

    def empty_cache(self):
        self.counters["reserved"] = self.counters.get("allocated", 0)

    def reset_peak_memory_stats(self, index):
        self.counters["peak"] = self.counters.get("allocated", 0)

    # streams and events
    def current_stream(self, index=None):
        return FakeStream()

    def Stream(self, device=None):  # noqa: N802 - mirrors torch.cuda.Stream
        return FakeStream()

    def Event(self):  # noqa: N802 - mirrors torch.cuda.Event
        return FakeEvent()

    @contextlib.contextmanager
    def stream(self, raw):
        previous, self.active = getattr(self, "active", None), raw
        try:
            yield
        finally:
            self.active = previous


class FakeStream:
    def __init__(self):
        self.waited = []
        self.synchronized = 0

    def wait_event(self, event):
        self.waited.append(event)

    def synchronize(self):
        self.synchronized += 1


class FakeEvent:
    def __init__(self):
        self.recorded_on = None

    def record(self, stream):
        self.recorded_on = stream

    def query(self):
        return True

    def synchronize(self):
        pass
