"""The same-host shared-memory ring of a WorkerProducer
(docs/shared_memory.md): chunk_bytes slots in a POSIX shared-memory object
the worker maps read-only."""
from __future__ import annotations

import mmap
import os

import grpc

from kvcal.client import Client, KvcalError
from kvcal.v1 import pb


# RegisterSharedMemory codes after which a producer sends in-band instead
# (the C++ SharedMemoryFallsBack): another host or shared memory off, an
# older worker, no room for the region.
_SHM_FALLBACK = {grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNIMPLEMENTED,
                 grpc.StatusCode.RESOURCE_EXHAUSTED}


def _host_boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


class _SharedMemoryFull(OSError):
    """/dev/shm has no room for the pages of a ring slot."""


class _SharedMemoryRing:
    """A POSIX shared-memory object of `slots` slots, registered with one
    worker at a time."""

    def __init__(self, slots: int, slot_bytes: int):
        import secrets
        from multiprocessing import shared_memory

        self.slots = max(1, int(slots))
        self.slot_bytes = max(64, (int(slot_bytes) + 63) // 64 * 64)
        name = f"kvcal-py-{os.getpid()}-{secrets.token_hex(6)}"
        self._shm = shared_memory.SharedMemory(name=name, create=True,
                                               size=self.slots * self.slot_bytes)
        self._fd = getattr(self._shm, "_fd", -1)  # POSIX
        # Bytes allocated from each slot's start: a slot's pages are
        # allocated when a chunk first needs them (put), so a ring of
        # window x chunk_bytes costs what its chunks use, not its size
        # (fallocate of 16 x 4 MiB up front, and the worker then mapping
        # every page, cost ~30 ms per producer).
        self._allocated = [0] * self.slots
        self.name = "/" + name
        self.region_id = 0
        self._client = None

    @property
    def byte_size(self) -> int:
        return self.slots * self.slot_bytes

    def register(self, client: Client) -> None:
        """Registers with `client`'s worker (after unregistering an earlier
        registration); raises KvcalError."""
        self.unregister()
        region = client._call(
            f"RegisterSharedMemory({self.name})", client.stub.RegisterSharedMemory,
            pb.RegisterSharedMemoryRequest(kind=pb.SHARED_MEMORY_KIND_SYSTEM, name=self.name,
                                           byte_size=self.byte_size, host_id=_host_boot_id()))
        self.region_id = region.region_id
        self._client = client

    def unregister(self) -> None:
        if self.region_id and self._client is not None:
            try:
                self._client._call("UnregisterSharedMemory",
                                   self._client.stub.UnregisterSharedMemory,
                                   pb.UnregisterSharedMemoryRequest(region_id=self.region_id),
                                   timeout=2.0)
            except KvcalError:
                pass  # best effort: a worker that is gone forgot it anyway
        self.region_id = 0

    def put(self, sequence: int, data: memoryview) -> pb.SharedMemoryReference:
        """Copies `data` into the slot of `sequence`; the reference to it.
        Raises _SharedMemoryFull when /dev/shm has no room for its pages."""
        slot = (sequence - 1) % self.slots
        offset = slot * self.slot_bytes
        n = len(data)
        have = self._allocated[slot]
        if n > have and self._fd >= 0:
            # Allocate the pages before writing them: a full /dev/shm (64 MiB
            # in a default container) is an error here, not a SIGBUS on the
            # write below.
            want = min(self.slot_bytes, -(-n // mmap.PAGESIZE) * mmap.PAGESIZE)
            try:
                os.posix_fallocate(self._fd, offset + have, want - have)
            except OSError as e:
                raise _SharedMemoryFull(
                    f"cannot allocate {want - have} bytes of shared memory in /dev/shm for "
                    f"slot {slot} of {self.name}: {e}") from None
            self._allocated[slot] = want
        self._shm.buf[offset:offset + n] = data
        return pb.SharedMemoryReference(region_id=self.region_id, offset=offset, byte_size=n)

    def close(self) -> None:
        self.unregister()
        try:
            self._shm.close()
        finally:
            try:
                self._shm.unlink()
            except FileNotFoundError:
                pass
