"""Listeners: the one way to receive step records as they arrive, shared by ``Session`` and ``Run``.

::

    remove = run.add_listener(lambda record: print(record.step, record.wall_ms))
    ...
    remove()                       # or run.remove_listener(that_callback)

Listeners are the stream (each record once, as it is made); ``Run.tail`` / ``Run.latest`` /
``Run.steps_completed`` and ``Session.last_record`` are the current state, for polling.

Rules, the same for both owners:

* listeners are called in registration order, on the thread that made the record (a background
  ``Run``'s thread, the thread calling ``Session.step``);
* adding and removing is thread-safe and allowed at any time, from a listener too; a listener added
  while a record is being delivered gets the next one, a removed one is not called again (unless the
  call is already under way on another thread);
* registering the same callback twice calls it twice; ``add_listener`` returns a function that removes
  that one registration (calling it again does nothing);
* an exception from a listener propagates to the owner's caller at once (the listeners after it miss
  that record); what that means for a run or a step is said by the owner (``Run``, ``Session.step``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from um_lab.types import StepRecord

#: A listener: called with each :class:`~um_lab.types.StepRecord`; what it returns is ignored.
Listener = Callable[[StepRecord], object]


class _Entry:
    """One registration: the callback and whether it is still registered."""

    __slots__ = ("active", "callback")

    def __init__(self, callback: Listener) -> None:
        self.callback = callback
        self.active = True


class RecordListeners:
    """An ordered, thread-safe list of listeners (see the module docstring for the rules)."""

    def __init__(self) -> None:
        self._entries: list[_Entry] = []
        self._lock = threading.Lock()

    def add(self, callback: Listener) -> Callable[[], None]:
        """Register ``callback`` last; returns a function that removes this registration."""
        if not callable(callback):
            raise TypeError(f"a listener must be callable, got {type(callback).__name__}")
        entry = _Entry(callback)
        with self._lock:
            self._entries.append(entry)

        def remove() -> None:
            """Remove this registration (nothing happens if it is already gone)."""
            self._drop(entry)

        return remove

    def remove(self, callback: Listener) -> None:
        """Remove the earliest registration of ``callback`` (``==``, so a fresh bound method matches).

        Raises ``ValueError`` if it is not registered."""
        with self._lock:
            for entry in self._entries:
                if entry.callback == callback:
                    entry.active = False
                    self._entries.remove(entry)
                    return
        raise ValueError(f"{callback!r} is not a registered listener")

    def _drop(self, entry: _Entry) -> None:
        with self._lock:
            entry.active = False
            if entry in self._entries:
                self._entries.remove(entry)

    def emit(self, record: StepRecord) -> None:
        """Call each listener registered now with ``record``, in order; the first exception propagates."""
        with self._lock:
            entries = tuple(self._entries)  # a copy: listeners may be added or removed meanwhile
        for entry in entries:
            if entry.active:  # removed since the copy: not called
                entry.callback(record)

    def __len__(self) -> int:
        """How many registrations there are."""
        with self._lock:
            return len(self._entries)


class Listenable:
    """Mixin giving ``add_listener`` / ``remove_listener``; the class sets ``self._listeners`` in ``__init__``."""

    _listeners: RecordListeners

    def add_listener(self, callback: Listener) -> Callable[[], None]:
        """Call ``callback(record)`` with each new step record; returns a function that removes it again."""
        return self._listeners.add(callback)

    def remove_listener(self, callback: Listener) -> None:
        """Stop calling ``callback`` (its earliest registration); ``ValueError`` if it is not registered."""
        self._listeners.remove(callback)
