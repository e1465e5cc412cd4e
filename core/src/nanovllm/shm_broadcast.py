"""A one-writer, many-reader broadcast through shared memory, for ranks on one host.

Rank 0 sends each step's plan to the other ranks of its host through this instead of the gloo control
group when the engine started the ranks itself: a pickled message costs a copy into shared memory and a
flag, not a round of socket messages. ``torchrun`` and multi-host worlds keep the gloo control group.

A message is pickled with its numpy arrays (a step plan's bulk) taken out as raw bytes and its attrs
records as plain field values (:class:`_Pickler`: numpy's and attrs' own pickling cost more than the copy).
On the wire it is its length and the pickle's (8 bytes each), the arrays (each padded to ``ALIGN`` bytes),
then the pickle. The segment is a ring of ``num_slots`` slots of ``slot_bytes``; a message is cut into
chunks of one slot each: chunk ``k`` (counted from 1 over the channel's life) goes to slot
``(k - 1) % num_slots``. Each slot has a header of int64 words: the number of the chunk written there last,
then one word per reader, the number of the chunk it read there last. The writer fills a slot once every
reader has read the chunk before (``k - num_slots``), copies the chunk, then stores ``k``; a reader waits for
``k``, copies the chunk out, then stores ``k`` in its word. Chunk numbers only grow, so a slot is never
mistaken for an older one. The protocol relies on the host keeping stores in program order, as x86-64 does
(:func:`stores_stay_in_order`); elsewhere (arm64) the engine keeps the gloo control group.

Waiting readers spin for ``SPIN_SECONDS``, then yield the CPU until ``YIELD_SECONDS``, then sleep in
``SLEEP_SECONDS`` steps (an idle engine's workers then cost little CPU). The creator owns the segment: it
unlinks the name once every reader has attached (:meth:`unlink`), so a crash leaves nothing in /dev/shm
after that; before it, multiprocessing's resource tracker removes the segment once the processes are gone
(and warns of a leaked shared_memory object).
"""

from __future__ import annotations

import importlib
import io
import math
import os
import pickle
import platform
import secrets
import time
from collections.abc import Callable
from multiprocessing import resource_tracker, shared_memory
from typing import Any

import attrs
import numpy as np

SPIN_SECONDS = 0.002
YIELD_SECONDS = 0.05
SLEEP_SECONDS = 0.0005
LIVENESS_SECONDS = 0.1  # how often a writer that waits for a slot checks that its readers are alive
NAME_PREFIX = "nanovllm-tp-"
WORD = 8
LENGTHS = 16  # the message's length and its pickle's, at its start
ALIGN = 16  # every array's bytes start at a multiple of this in the message


def stores_stay_in_order() -> bool:
    """Whether other cores see this host's stores in program order (x86-64's total store order), which the
    ring's flags rely on: Python has no memory fence to order them on weaker hosts such as arm64."""
    return platform.machine().lower() in ("x86_64", "amd64")


def _rebuild(*args: Any) -> Any:
    """Names, in a pickle, the rebuilding of an array or record; a reader resolves the name to a
    :class:`_Rebuilder` of its message (see :class:`_Unpickler`), so this is never called."""
    raise RuntimeError("messages of nanovllm.shm_broadcast are read with ShmBroadcast.read")


class _Pickler(pickle.Pickler):
    """Pickles numpy arrays as (dtype, shape, offset) of their bytes, kept in ``arrays`` to follow the
    pickle, and attrs records as their class's name and field values. Numpy's and attrs' own pickling
    look up a few globals per object, which costs more than copying a step plan's bytes."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.arrays: list[np.ndarray] = []
        self.offset = LENGTHS

    def reducer_override(self, obj: Any) -> Any:  # called only for objects of non-builtin types
        cls = type(obj)
        if cls is np.ndarray and not obj.dtype.hasobject:
            array = obj if obj.flags.c_contiguous else obj.copy()  # (ascontiguousarray makes 0-d arrays 1-d)
            self.arrays.append(array)
            reference = (array.dtype.str, array.shape, self.offset)
            self.offset += -(-array.nbytes // ALIGN) * ALIGN
            return _rebuild, reference
        if attrs.has(cls):
            fields = [getattr(obj, a.name) for a in cls.__attrs_attrs__]
            return _rebuild, (cls.__module__, cls.__qualname__, *fields)
        return NotImplemented


_record_classes: dict[tuple[str, str], type] = {}  # (module, qualified name) -> class, as a reader found it


class _Rebuilder:
    """Rebuilds the objects of one message: arrays as views of its (writable) bytes, records field by field
    (without running ``__init__``: the values are the writer's)."""

    def __init__(self, message: bytearray) -> None:
        self.message = message

    def __call__(self, first: Any, second: Any, third: Any, *fields: Any) -> Any:
        if type(second) is tuple:  # an array: dtype, shape, offset
            return np.frombuffer(self.message, first, math.prod(second), third).reshape(second)
        cls = _record_classes.get((first, second))
        if cls is None:
            cls = importlib.import_module(first)
            for part in second.split("."):
                cls = getattr(cls, part)
            _record_classes[first, second] = cls
        record = cls.__new__(cls)
        for attribute, value in zip(cls.__attrs_attrs__, (third, *fields), strict=True):
            object.__setattr__(record, attribute.name, value)
        return record


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, message: bytearray) -> None:
        super().__init__(file)
        self.message = message

    def find_class(self, module: str, name: str) -> Any:
        if module == __name__ and name == "_rebuild":
            return _Rebuilder(self.message)  # not a method of self: the memo would hold a cycle to self
        return super().find_class(module, name)


def encode(message: Any) -> bytes:
    """``message`` on the wire: its length and its pickle's, the arrays' bytes, then the pickle."""
    file = io.BytesIO()
    pickler = _Pickler(file)
    pickler.dump(message)
    parts = []
    for array in pickler.arrays:
        if array.nbytes:
            parts.append(memoryview(array).cast("B"))
        parts.append(bytes(-array.nbytes % ALIGN))
    pickled = file.getbuffer()
    total = pickler.offset + len(pickled)
    return b"".join([total.to_bytes(8, "little"), len(pickled).to_bytes(8, "little"), *parts, pickled])


def decode(data: bytearray) -> Any:
    """The message of :func:`encode`'s bytes; its arrays are views of ``data``."""
    pickled = int.from_bytes(data[8:16], "little")
    return _Unpickler(io.BytesIO(memoryview(data)[len(data) - pickled :]), data).load()


class ShmBroadcast:
    """One end of the channel: the writer (``create``) or reader ``reader`` (``attach``)."""

    def __init__(self, memory: shared_memory.SharedMemory, num_readers: int, num_slots: int, slot_bytes: int,
                 reader: int | None, readers_alive: Callable[[], bool] | None) -> None:
        self.memory = memory
        self.name = memory.name
        self.num_readers, self.num_slots, self.slot_bytes = num_readers, num_slots, slot_bytes
        self.reader = reader
        self.readers_alive = readers_alive
        self.linked = reader is None  # the creator unlinks the name
        self._words = memory.buf[: self._header_bytes(num_readers, num_slots)].cast("q")
        self._data = memory.buf[self._header_bytes(num_readers, num_slots) :]
        self._chunk = 0  # chunks written, or read by this reader

    @staticmethod
    def _header_bytes(num_readers: int, num_slots: int) -> int:
        return num_slots * (1 + num_readers) * WORD

    @classmethod
    def create(cls, num_readers: int, num_slots: int = 4, slot_bytes: int = 1 << 20,
               readers_alive: Callable[[], bool] | None = None) -> ShmBroadcast:
        """A new channel, this process its writer. ``readers_alive`` (optional) tells a writer that waits for
        a slot whether the readers are still there; if not, the write raises instead of waiting forever."""
        size = cls._header_bytes(num_readers, num_slots) + num_slots * slot_bytes
        # the tracker first: started by the segment's registration, it would leave a window in which a crash
        # leaves the segment untracked
        resource_tracker.ensure_running()
        memory = shared_memory.SharedMemory(NAME_PREFIX + secrets.token_hex(8), create=True, size=size)
        return cls(memory, num_readers, num_slots, slot_bytes, None, readers_alive)

    @classmethod
    def attach(cls, name: str, num_readers: int, reader: int, num_slots: int = 4,
               slot_bytes: int = 1 << 20) -> ShmBroadcast:
        """Reader ``reader`` (0 .. num_readers - 1) of the channel ``name``, made with the same sizes."""
        return cls(shared_memory.SharedMemory(name), num_readers, num_slots, slot_bytes, reader, None)

    def _header(self, slot: int) -> int:
        return slot * (1 + self.num_readers)

    def write(self, message: Any) -> None:
        """Send ``message`` (picklable) to every reader; waits only while the ring is full."""
        data = memoryview(encode(message))
        for start in range(0, len(data), self.slot_bytes):
            self._chunk += 1
            slot = (self._chunk - 1) % self.num_slots
            header = self._header(slot)
            previous = self._chunk - self.num_slots
            if any(self._words[header + 1 + r] < previous for r in range(self.num_readers)):
                self._wait_for_readers(header, previous)
            chunk = data[start : start + self.slot_bytes]
            offset = slot * self.slot_bytes
            self._data[offset : offset + len(chunk)] = chunk
            self._words[header] = self._chunk  # publishes the chunk: stored last

    def _wait_for_readers(self, header: int, previous: int) -> None:
        start = last_check = time.perf_counter()
        while any(self._words[header + 1 + r] < previous for r in range(self.num_readers)):
            now = _pause(start)
            if self.readers_alive is not None and now - last_check > LIVENESS_SECONDS:
                last_check = now
                if not self.readers_alive():
                    raise RuntimeError("a tensor-parallel worker stopped reading the step channel: it exited")

    def read(self) -> Any:
        """The next message; waits for it as long as it takes."""
        chunk = self._read_chunk()
        length = int.from_bytes(chunk[:8], "little")
        data = bytearray(length)
        done = 0
        while True:
            size = min(self.slot_bytes, length - done)
            data[done : done + size] = chunk[:size]
            self._release()
            done += size
            if done == length:
                return decode(data)
            chunk = self._read_chunk()

    def _read_chunk(self) -> memoryview:
        """The next chunk's slot (to be released with :meth:`_release` once copied out)."""
        self._chunk += 1
        slot = (self._chunk - 1) % self.num_slots
        header = self._header(slot)
        if self._words[header] != self._chunk:
            start = time.perf_counter()
            while self._words[header] != self._chunk:
                _pause(start)
        offset = slot * self.slot_bytes
        return self._data[offset : offset + self.slot_bytes]

    def _release(self) -> None:
        slot = (self._chunk - 1) % self.num_slots
        self._words[self._header(slot) + 1 + self.reader] = self._chunk

    def unlink(self) -> None:
        """The creator removes the name (the memory stays while any process has it mapped)."""
        if self.linked:
            self.linked = False
            self.memory.unlink()

    def close(self) -> None:
        """Unmap the segment (the creator also unlinks it, if it has not yet)."""
        self.unlink()
        self._words.release()
        self._data.release()
        self.memory.close()


def _pause(start: float) -> float:
    """One wait step of a spinning, then yielding, then sleeping waiter; returns the time now."""
    now = time.perf_counter()
    waited = now - start
    if waited > YIELD_SECONDS:
        time.sleep(SLEEP_SECONDS)
    elif waited > SPIN_SECONDS:
        os.sched_yield()
    return now
