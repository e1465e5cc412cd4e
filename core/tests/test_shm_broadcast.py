"""The shared-memory step broadcast of tensor-parallel ranks on one host.

Two reader processes get every message in order, with numpy arrays of any dtype and layout intact and
writable and attrs records (plain, frozen, nested) rebuilt, through a ring small enough that messages span
several slots and wrap around it many times; a writer whose reader died raises instead of waiting forever;
the creator unlinks the segment's name, a reader never does, and nothing is left in /dev/shm once both ends
are closed.
"""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

import attrs
import numpy as np
import pytest
from nanovllm.shm_broadcast import ShmBroadcast

SLOTS, SLOT_BYTES = 3, 256  # a tiny ring: most messages below take several slots


@attrs.define
class Record:
    ids: np.ndarray
    inner: object = None


@attrs.frozen
class Frozen:
    count: int
    names: tuple[str, ...]


def messages() -> list:
    rng = np.random.default_rng(0)
    big = rng.integers(-(2**40), 2**40, size=(40, 33))  # 10 KiB: 40 slots
    return [
        ("stop",),
        {"ids": [1, 2, 3], "nested": ("a", None, 2.5)},
        ("step", np.arange(12, dtype=np.int32).reshape(3, 4), np.array(7, dtype=np.int16)),
        np.arange(10.0)[::3],  # not contiguous
        np.zeros((0, 5), dtype=np.float32),
        big,
        np.array(["x", None, 3], dtype=object),  # pickled the ordinary way
        [np.arange(5, dtype=np.uint8), np.ones(3, dtype=np.bool_), big.T],
        ("step", Record(np.arange(6, dtype=np.int64), Record(np.zeros(2), Frozen(3, ("a", "b")))), None),
    ] * 4


def same(a, b) -> bool:
    if isinstance(a, np.ndarray):
        return type(b) is np.ndarray and a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if attrs.has(type(a)):
        names = [f.name for f in attrs.fields(type(a))]
        return type(a) is type(b) and all(same(getattr(a, n), getattr(b, n)) for n in names)
    return a == b


def arrays(message) -> list[np.ndarray]:
    if isinstance(message, np.ndarray):
        return [message]
    if attrs.has(type(message)):
        return arrays(attrs.astuple(message, recurse=False))
    if isinstance(message, (list, tuple)):
        return [a for m in message for a in arrays(m)]
    return []


def read_all(name: str, reader: int, count: int, results) -> None:
    channel = ShmBroadcast.attach(name, 2, reader, num_slots=SLOTS, slot_bytes=SLOT_BYTES)
    got = []
    for _ in range(count):
        message = channel.read()
        for array in arrays(message):
            if array.dtype != object:
                assert array.flags.writeable  # the runner writes into a plan's input ids
        got.append(message)
    results.put((reader, got))
    channel.close()


def test_readers_get_every_message_in_order():
    context = multiprocessing.get_context("spawn")
    channel = ShmBroadcast.create(2, num_slots=SLOTS, slot_bytes=SLOT_BYTES)
    sent = messages()
    results = context.Queue()
    readers = [context.Process(target=read_all, args=(channel.name, r, len(sent), results)) for r in range(2)]
    try:
        for reader in readers:
            reader.start()
        for message in sent:
            channel.write(message)
        got = dict(results.get(timeout=60) for _ in readers)
        for reader in readers:
            reader.join(10)
            assert reader.exitcode == 0
    finally:
        channel.close()
    for r in range(2):
        assert len(got[r]) == len(sent)
        for want, message in zip(sent, got[r], strict=True):
            assert same(want, message), (r, want)


def attach_and_exit(name: str) -> None:
    ShmBroadcast.attach(name, 1, 0, num_slots=SLOTS, slot_bytes=SLOT_BYTES).close()


def test_a_writer_whose_reader_died_raises():
    readers: list[multiprocessing.Process] = []
    channel = ShmBroadcast.create(1, num_slots=SLOTS, slot_bytes=SLOT_BYTES,
                                  readers_alive=lambda: all(r.exitcode is None for r in readers))
    reader = multiprocessing.get_context("spawn").Process(target=attach_and_exit, args=(channel.name,))
    readers.append(reader)
    try:
        reader.start()
        reader.join(60)
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="stopped reading the step channel"):
            for _ in range(SLOTS + 1):  # the ring fills, and nobody reads it
                channel.write("step")
        assert time.monotonic() - start < 5
    finally:
        channel.close()


def test_the_creator_unlinks_the_name_and_closing_leaves_nothing():
    channel = ShmBroadcast.create(1, num_slots=SLOTS, slot_bytes=SLOT_BYTES)
    path = Path("/dev/shm", channel.name)
    reader = ShmBroadcast.attach(channel.name, 1, 0, num_slots=SLOTS, slot_bytes=SLOT_BYTES)
    reader.close()
    assert path.exists()  # a reader never unlinks
    reader = ShmBroadcast.attach(channel.name, 1, 0, num_slots=SLOTS, slot_bytes=SLOT_BYTES)
    channel.unlink()
    assert not path.exists()
    channel.write(("still", np.arange(3)))  # the memory lives while it is mapped
    assert same(reader.read(), ("still", np.arange(3)))
    reader.close()
    channel.close()
    other = ShmBroadcast.create(1)
    other.close()  # closing unlinks too
    assert not Path("/dev/shm", other.name).exists()
