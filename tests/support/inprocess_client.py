"""The calls ``EngineGenerator`` makes on an ``EngineClient``, served by an engine adapter in this process.

No server, no socket: the adapter steps only when a completion is asked for, so a stream's order, the point where
it is aborted or suspended and every token count are the same on every run (the server path depends on timing).
"""
from __future__ import annotations

import collections


class InProcessClient:
    def __init__(self, adapter):
        self.adapter = adapter
        self.ready: collections.deque = collections.deque()
        self.updates = 0

    def submit(self, requests) -> None:
        for r in requests:
            self.adapter.add(r)

    def next_completion(self, timeout_s=None):
        while not self.ready:
            if not self.adapter.has_work():
                raise RuntimeError("next_completion with nothing running")
            self.ready.extend(self.adapter.step())
        return self.ready.popleft()

    def idle_seconds(self) -> float:
        return 0.0  # the adapter steps only when a completion is asked for: no wall time of its own to count

    def abort(self, ids) -> int:
        done = self.adapter.abort(list(ids))
        self.ready.extend(done)
        return len(done)

    def update_weights(self, buckets) -> dict:
        n = 0
        for bucket in buckets:
            self.adapter.load_weights(bucket)
            n += len(bucket)
        self.adapter.finish_weights()
        self.updates += 1
        return {"tensors": n}

    def sleep(self, level: int = 1) -> None:
        self.adapter.sleep(level)

    def wake(self, tags=None) -> None:
        self.adapter.wake(tags)
