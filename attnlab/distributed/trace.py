"""What each rank did and when: compute spans, transfers in flight, waits, and the bytes it sent and received.

A :class:`Trace` is handed to ``ring_attention(..., trace=t)`` or ``ulysses_attention(..., trace=t)``; the
forward and the backward add to it. Times are ``time.perf_counter()`` seconds, one clock for every process
of a machine (Linux's monotonic clock), so the ranks' traces line up on one timeline. A transfer spans from
the moment its sends and receives are posted to the moment the wait for them returns; the part of it spent
waiting is communication the compute did not hide.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

__all__ = ["Event", "Trace"]

KINDS = ("compute", "transfer", "wait")


@dataclass
class Event:
    """One span on a rank's timeline: ``kind`` in compute, transfer, wait; ``phase`` forward or backward."""

    phase: str
    kind: str
    start: float
    end: float
    bytes_sent: int = 0
    bytes_received: int = 0

    @property
    def seconds(self):
        return self.end - self.start


@dataclass
class Trace:
    """A rank's events; ``flops`` counts the attention FLOPs it computed, per phase."""

    rank: int = 0
    events: list = field(default_factory=list)
    flops: dict = field(default_factory=dict)

    @contextlib.contextmanager
    def compute(self, phase):
        start = time.perf_counter()
        yield
        self.events.append(Event(phase, "compute", start, time.perf_counter()))

    def add_flops(self, phase, flops):
        self.flops[phase] = self.flops.get(phase, 0) + int(flops)

    def add(self, phase, kind, start, end, sent=0, received=0):
        self.events.append(Event(phase, kind, start, end, int(sent), int(received)))

    def _select(self, kind, phase):
        return [e for e in self.events if e.kind == kind and (phase is None or e.phase == phase)]

    def bytes_sent(self, phase=None):
        """Bytes this rank sent (``phase`` "forward", "backward" or None for both)."""
        return sum(e.bytes_sent for e in self._select("transfer", phase))

    def bytes_received(self, phase=None):
        return sum(e.bytes_received for e in self._select("transfer", phase))

    def seconds(self, kind, phase=None):
        """Total seconds of ``kind`` (compute, transfer, wait) in ``phase``."""
        return sum(e.seconds for e in self._select(kind, phase))

    def summary(self, phase=None):
        """A dict: rank, bytes sent/received, FLOPs, and seconds of compute, transfer and wait."""
        flops = sum(self.flops.values()) if phase is None else self.flops.get(phase, 0)
        return {"rank": self.rank, "bytes_sent": self.bytes_sent(phase), "bytes_received": self.bytes_received(phase),
                "flops": flops, **{f"{kind}_s": self.seconds(kind, phase) for kind in KINDS}}
