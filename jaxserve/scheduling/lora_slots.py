"""Which adapter sits in which device slot, and which slots running requests pin.

The device holds `max_loras` adapter slots (jaxserve/models/lora.py), numbered 1..max_loras (0
is "no adapter"); more adapters may be registered, in host memory. A request that names an
adapter is admitted only once its adapter has a slot: the slot it already holds, else a free
one, else the least recently used slot that no running request pins. The new occupant is
reported in the plan (`SchedulerOutput.lora_loads`), and the engine writes its weights into the
slot before it dispatches that plan's step. While every slot is pinned by running requests of
other adapters the request waits (admission sets it aside, as one waiting for shared pages),
and requests behind it whose adapter is in, or that use none, go ahead.

Plain Python, like the rest of the scheduler: names and ints, no weights.
"""

from __future__ import annotations

import collections


class LoraSlots:
    """Adapter names in device slots: pins by running requests, least recently used first out."""

    def __init__(self, max_loras: int):
        self.max_loras = max_loras
        self._slot_of: dict[str, int] = {}  # adapter in a slot -> its slot
        self._pins: collections.Counter[str] = collections.Counter()  # running requests of each
        # In a slot, pinned by no running request: evicted oldest first.
        self._idle: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._free = list(range(max_loras, 0, -1))  # pop() gives the lowest slot
        self.num_loads = 0  # adapters written into a slot since start, for metrics and tests

    def pinned(self) -> list[str]:
        """The adapters of running requests, by name: at most `max_loras` of them."""
        return sorted(self._pins)

    def slot_of(self, name: str) -> int | None:
        return self._slot_of.get(name)

    def can_acquire(self, name: str) -> bool:
        """Whether a request of `name` could take a slot now."""
        return name in self._slot_of or bool(self._free) or bool(self._idle)

    def acquire(self, name: str) -> tuple[int, bool]:
        """Pins `name`'s slot for one more running request: (slot, whether it must be loaded).

        Raises RuntimeError when every slot is pinned (check `can_acquire` first).
        """
        slot = self._slot_of.get(name)
        loaded = slot is None
        if loaded:
            if self._free:
                slot = self._free.pop()
            elif self._idle:
                evicted, _ = self._idle.popitem(last=False)
                slot = self._slot_of.pop(evicted)
            else:
                raise RuntimeError(
                    f"Adapter {name!r} needs a slot but all {self.max_loras} are pinned by "
                    f"running requests."
                )
            self._slot_of[name] = slot
            self.num_loads += 1
        self._idle.pop(name, None)
        self._pins[name] += 1
        return slot, loaded

    def release(self, name: str) -> None:
        """A running request of `name` stopped (finished or preempted): one pin fewer."""
        self._pins[name] -= 1
        if self._pins[name] <= 0:
            del self._pins[name]
            self._idle[name] = None  # most recently used: evicted last

    def forget(self, name: str) -> None:
        """`name` was unregistered (or replaced): its slot, if idle, is free again, so a new
        adapter of the same name is loaded afresh. Raises ValueError while it is pinned."""
        if self._pins.get(name):
            raise ValueError(f"Adapter {name!r} is in use by {self._pins[name]} running requests.")
        if name in self._slot_of:
            self._idle.pop(name, None)
            self._free.append(self._slot_of.pop(name))
            self._free.sort(reverse=True)

    def check_invariants(self, running_names: list[str]) -> None:
        """Raises AssertionError unless the pins are the running requests' adapters and every
        slot is free or held by one adapter."""
        if collections.Counter(running_names) != self._pins:
            raise AssertionError(f"Pins {dict(self._pins)} != running adapters {running_names}.")
        held = sorted(self._slot_of.values())
        if sorted(held + self._free) != list(range(1, self.max_loras + 1)):
            raise AssertionError(f"Slots held {self._slot_of} and free {self._free} disagree.")
        if set(self._idle) != set(self._slot_of) - set(self._pins):
            raise AssertionError(f"Idle {list(self._idle)} != held and unpinned adapters.")
