"""A byte budget shared by a receiver's connections: an asyncio semaphore counted in bytes.

A connection handler ``acquire``s the bytes of a payload before it reads (and decompresses)
it, and they are ``release``d when the consumer is done with the item (or it is dropped). So
what all the connections of one receiver hold together never exceeds ``total``, however many
connections there are and whatever their frames claim.

Waiters are served first come, first served: a large request at the head is not starved by
a stream of small ones behind it. A request larger than ``total`` can never be met and is
refused at once (BudgetError); any other one waits until it fits.
"""

from __future__ import annotations

import asyncio
from collections import deque


class BudgetError(ValueError):
    """A request that can never fit the budget."""


class BudgetClosedError(ConnectionError):
    """The budget was closed (its receiver is closing) while a request waited."""


class ByteBudget:
    """``total`` bytes for many tasks of one event loop; ``held`` and ``peak`` say the use."""

    def __init__(self, total: int) -> None:
        if total <= 0:
            raise ValueError(f"a byte budget must be positive, got {total}")
        self.total = total
        self.held = 0
        self.peak = 0
        self.waits = 0  # requests that had to wait for room
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()
        self._closed = False

    async def acquire(self, nbytes: int) -> None:
        """Take ``nbytes``, waiting (FIFO) until they fit. BudgetError if they never can,
        BudgetClosedError if the budget is closed."""
        if nbytes < 0:
            raise ValueError(f"cannot acquire {nbytes} bytes")
        if nbytes > self.total:
            raise BudgetError(f"{nbytes} bytes can never fit the {self.total}-byte budget")
        if self._closed:
            raise BudgetClosedError("the byte budget is closed")
        if nbytes == 0:
            return
        if not self._waiters and self.held + nbytes <= self.total:
            self._take(nbytes)
            return
        self.waits += 1
        entry = (nbytes, asyncio.get_running_loop().create_future())
        self._waiters.append(entry)
        try:
            await entry[1]
        except BaseException:
            granted = entry[1].done() and not entry[1].cancelled() and not entry[1].exception()
            if granted:  # granted just as the waiter was cancelled: give the bytes back
                self.release(nbytes)
            else:
                if entry in self._waiters:
                    self._waiters.remove(entry)
                self._wake()  # the head may have left: those behind it may fit now
            raise

    def release(self, nbytes: int) -> None:
        """Give back ``nbytes`` acquired before; wakes the waiters that fit now."""
        if nbytes > self.held:
            raise RuntimeError(f"released {nbytes} bytes, only {self.held} are held")
        self.held -= nbytes
        self._wake()

    def close(self) -> None:
        """Fail every waiting request (BudgetClosedError) and every later one."""
        self._closed = True
        while self._waiters:
            _, future = self._waiters.popleft()
            if not future.done():
                future.set_exception(BudgetClosedError("the byte budget is closed"))

    def _take(self, nbytes: int) -> None:
        self.held += nbytes
        self.peak = max(self.peak, self.held)

    def _wake(self) -> None:
        while self._waiters and self.held + self._waiters[0][0] <= self.total:
            nbytes, future = self._waiters.popleft()
            if not future.done():  # a cancelled waiter is skipped
                self._take(nbytes)
                future.set_result(None)
