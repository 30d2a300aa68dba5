"""The ring: one POSIX shared-memory segment holding ``num_slots`` fixed-size slots.

Layout of a segment (all integers little-endian)::

    offset 0            ring header (64 bytes): magic b"SPECRING", layout version, num_slots,
                        slot_bytes, payload offset, creator pid, creator start time (both for people
                        reading a leftover segment: they say nothing about liveness), run id
    offset 64           slot headers, one 64-byte record per slot:
                            state u32 (0 EMPTY, 1 WRITING, 2 PUBLISHED), generation u32,
                            batch_id i64, payload_len u64, seq u64, checksum u32, flags u32
    payload offset      slot 0 payload, slot 1 payload, ...   (each ``slot_bytes``, a multiple of 4 KiB,
                        starting on a 4 KiB boundary)

What the ring guarantees, and what it does not:

* The segment lives until its creator calls ``unlink()`` (or a later ``sweep_stale()`` finds it without an
  owner). The creator holds a shared ``flock`` on the segment file from before its name appears until it
  unlinks it or exits; ``sweep_stale`` removes only segments whose lock it can take. The kernel, not a pid,
  says whether the lock is held, so this holds across PID namespaces that share ``/dev/shm`` (containers
  with ``--ipc=host``, a shared volume) and after pid reuse. Names carry a random run id, never a pid.
* Processes that ``attach()`` map the file themselves: no ``multiprocessing`` resource tracker is
  involved, so an attaching process that exits (even by SIGKILL) never unlinks it.
* A writer marks a slot ``WRITING`` before touching the payload and ``PUBLISHED`` (last store) after the
  payload is complete, so a reader or the creator can always tell that a slot whose writer died was never
  published. Which slot may be written or read is decided by the coordinator, not by the ring: the ring has
  no locks, and a dead writer's slot must only be reused after that writer has been seen to exit.
* Where CUDA is available, ``pin()`` registers the mapping with ``cudaHostRegister`` in this process (pinned
  memory: fast, asynchronous host↔device copies); ``close()`` unregisters before unmapping. Without CUDA
  everything works unpinned.
* Creation reserves the pages (``posix_fallocate``) after checking free space, so a full ``/dev/shm`` is a
  clear ``ShmSpaceError`` at start-up rather than a SIGBUS in the middle of a run.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import re
import secrets
import struct
import time
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import psutil

from specring.shared.errors import ShmSpaceError, SlotError

# torch is imported where a tensor view is first made (``Ring._buf``), so that `launch.py clean`, which only
# reads headers and unlinks, starts without it (1.43 s -> 0.22 s on 2 cores)
if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
NAME_PREFIX = "specring-"
MAGIC = b"SPECRING"
LAYOUT_VERSION = 1
PAGE = 4096
# magic, version, num_slots, slot_bytes, payload_off, pid, start, run_id
RING_HEADER = struct.Struct("<8sIIQQIdxxxx16s")
SLOT_HEADER = struct.Struct("<IIqQQII")           # state, generation, batch_id, payload_len, seq, checksum, flags
SLOT_HEADER_BYTES = 64
EMPTY, WRITING, PUBLISHED = 0, 1, 2
STATE_NAMES = {EMPTY: "EMPTY", WRITING: "WRITING", PUBLISHED: "PUBLISHED"}
FLAG_CHECKSUM = 1
# specring-<run>-<tag>; segments of older builds carry the creator's pid too: specring-<run>-<pid>-<tag>
_NAME_RE = re.compile(r"^specring-(?P<run>[0-9A-Za-z]+)-(?:(?P<pid>\d+)-)?(?P<tag>[\w.]+)$")

assert RING_HEADER.size <= 64 and SLOT_HEADER.size <= SLOT_HEADER_BYTES


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def segment_name(run_id: str, tag: str) -> str:
    """Name of a ring segment: ``specring-<run_id>-<tag>``.

    ``run_id`` must be alphanumeric (``new_run_id()``: random, so unique without any pid), ``tag`` word
    characters or dots (e.g. ``p0``). Raises ``ValueError`` naming the bad part.
    """
    if not re.fullmatch(r"[0-9A-Za-z]+", run_id):
        raise ValueError(f"run_id must be alphanumeric, got {run_id!r}")
    if not re.fullmatch(r"[\w.]+", tag):
        raise ValueError(f"ring tag must be word characters, got {tag!r}")
    return f"{NAME_PREFIX}{run_id}-{tag}"


def segment_bytes(num_slots: int, slot_bytes: int) -> int:
    """Total bytes of a segment with ``num_slots`` slots of (at least) ``slot_bytes`` bytes each."""
    payload_off = _round_up(64 + num_slots * SLOT_HEADER_BYTES, PAGE)
    return payload_off + num_slots * _round_up(slot_bytes, PAGE)


def shm_free_bytes() -> int:
    """Free bytes in ``/dev/shm`` for an unprivileged writer."""
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize


def check_shm_space(needed_bytes: int, what: str = "rings") -> None:
    """Raise ``ShmSpaceError`` if ``/dev/shm`` has less than ``needed_bytes`` free, with both sizes in MiB."""
    free = shm_free_bytes()
    if needed_bytes > free:
        raise ShmSpaceError(
            f"{what} need {needed_bytes / 2**20:.1f} MiB of shared memory but {SHM_DIR} has only "
            f"{free / 2**20:.1f} MiB free; lower --num-slots/--slot-mb, run `launch.py clean`, "
            f"or enlarge {SHM_DIR}")


@dataclass(frozen=True)
class SlotHeader:
    """Decoded header of one slot."""
    state: int
    generation: int
    batch_id: int
    payload_len: int
    seq: int
    checksum: int
    flags: int

    @property
    def state_name(self) -> str:
        return STATE_NAMES.get(self.state, f"?{self.state}")


def _process_start_time(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None


class Ring:
    """A mapped ring segment. Create with ``Ring.create`` (the owner) or ``Ring.attach`` (everyone else).

    ``payload(i)`` is a 1-D ``uint8`` tensor view of slot ``i``'s ``slot_bytes`` payload bytes.
    Not thread-safe; one writer per slot at a time, as the coordinator arranges.
    """

    def __init__(self, name: str, mm: mmap.mmap, owner: bool, lock_fd: int | None = None):
        self.name = name
        self.owner = owner
        self._mm = mm
        magic, version, num_slots, slot_bytes, payload_off, _pid, _start, run_id = RING_HEADER.unpack_from(mm, 0)
        if magic != MAGIC:
            raise SlotError(f"segment {name} is not a specring ring (magic {magic!r})")
        if version != LAYOUT_VERSION:
            raise SlotError(f"segment {name} has layout version {version}; this build reads {LAYOUT_VERSION}")
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self.payload_offset = payload_off
        self.run_id = run_id.rstrip(b"\0").decode()
        self._view: torch.Tensor | None = None  # the whole mapping as uint8, made on first use (``_buf``)
        self.pinned = False
        self._closed = False
        self._lock_fd = lock_fd  # the creator's open, flock-ed descriptor of the segment (None: attached)

    @property
    def _buf(self) -> torch.Tensor:
        """The whole mapping as a 1-D ``uint8`` tensor (no copy), made on first use. Raises ``ValueError`` after
        ``close()``."""
        if self._view is None:
            if self._closed:
                raise ValueError(f"ring {self.name} is closed")
            import torch
            # Through a memoryview: it holds a buffer export on the mmap for as long as any tensor view lives,
            # so close() cannot unmap memory that a view still points at (torch.frombuffer(mm) alone only
            # keeps a reference, and mmap.close() would unmap under it: a later access is a SIGSEGV).
            self._view = torch.frombuffer(memoryview(self._mm), dtype=torch.uint8)
        return self._view

    # ---------------------------------------------------------------- life cycle
    @classmethod
    def create(cls, name: str, num_slots: int, slot_bytes: int) -> "Ring":
        """Create and map a new segment ``/dev/shm/<name>`` (mode 0600), pages reserved, owned by this process
        (its ``flock``, which no sweep overrides) until ``unlink()`` or the process's exit.

        ``slot_bytes`` is rounded up to a multiple of 4 KiB. Raises ``ValueError`` for non-positive sizes,
        ``FileExistsError`` if the name exists, ``ShmSpaceError`` if ``/dev/shm`` lacks space.
        """
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        if slot_bytes < 1:
            raise ValueError(f"slot_bytes must be >= 1, got {slot_bytes}")
        slot_bytes = _round_up(slot_bytes, PAGE)
        total = segment_bytes(num_slots, slot_bytes)
        check_shm_space(total, f"ring {name}")
        path = os.path.join(SHM_DIR, name)
        fd = _create_locked(path)
        try:
            try:
                os.posix_fallocate(fd, 0, total)
            except OSError as e:
                raise ShmSpaceError(f"could not reserve {total / 2**20:.1f} MiB for ring {name} in {SHM_DIR}: "
                                    f"{e.strerror}; {shm_free_bytes() / 2**20:.1f} MiB free") from None
            mm = mmap.mmap(fd, total, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.unlink(path)
            os.close(fd)
            raise
        run_id = name[len(NAME_PREFIX):].split("-", 1)[0] if name.startswith(NAME_PREFIX) else ""
        payload_off = _round_up(64 + num_slots * SLOT_HEADER_BYTES, PAGE)
        RING_HEADER.pack_into(mm, 0, MAGIC, LAYOUT_VERSION, num_slots, slot_bytes, payload_off, os.getpid(),
                              _process_start_time(os.getpid()) or 0.0, run_id.encode()[:16])
        return cls(name, mm, owner=True, lock_fd=fd)

    @classmethod
    def attach(cls, name: str) -> "Ring":
        """Map an existing segment by name (no resource tracker: exiting never unlinks it).

        Raises ``FileNotFoundError`` naming the segment if it does not exist.
        """
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise FileNotFoundError(f"ring segment {path} does not exist (was the run stopped or swept?)") from None
        try:
            size = os.fstat(fd).st_size
            if size < PAGE:
                raise SlotError(f"segment {path} is only {size} bytes: not a ring")
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        return cls(name, mm, owner=False)

    def pin(self) -> bool:
        """Register the mapping with CUDA (``cudaHostRegister``) if CUDA is available; returns whether pinned.

        Raises ``RuntimeError`` with CUDA's error code if registration fails.
        """
        import torch
        if self.pinned or not torch.cuda.is_available():
            return self.pinned
        n = self._buf.numel()
        if n == 0:
            return False
        torch.cuda.init()
        err = torch.cuda.cudart().cudaHostRegister(self._buf.data_ptr(), n, 0)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister of ring {self.name} ({n} bytes) failed with error {int(err)}")
        self.pinned = True
        return True

    def unpin(self) -> None:
        """Undo ``pin()`` (``cudaHostUnregister``); a no-op if not pinned."""
        if self.pinned:
            import torch
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaHostUnregister(self._buf.data_ptr())
            self.pinned = False

    def close(self) -> None:
        """Unpin and unmap (idempotent). Tensor views handed out keep the mapping alive until dropped."""
        if self._closed:
            return
        self._closed = True
        try:
            self.unpin()
        finally:
            self._view = None
            try:
                self._mm.close()
            except BufferError:
                pass  # views still exist; the mapping is released when the last one is dropped

    def unlink(self) -> None:
        """Remove the segment's name (owner only), then drop the owner's lock. Mappings stay valid, so copies
        in flight are safe."""
        try:
            os.unlink(os.path.join(SHM_DIR, self.name))
        except FileNotFoundError:
            pass
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def __enter__(self) -> "Ring":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
        if self.owner:
            self.unlink()

    # ---------------------------------------------------------------- slots
    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise SlotError(f"slot {slot} out of range for ring {self.name} with {self.num_slots} slots")

    def payload(self, slot: int) -> torch.Tensor:
        """1-D ``uint8`` tensor view (no copy) of slot ``slot``'s payload, ``slot_bytes`` long."""
        self._check_slot(slot)
        off = self.payload_offset + slot * self.slot_bytes
        return self._buf[off:off + self.slot_bytes]

    def header(self, slot: int) -> SlotHeader:
        """The current header of slot ``slot``."""
        self._check_slot(slot)
        return SlotHeader(*SLOT_HEADER.unpack_from(self._mm, 64 + slot * SLOT_HEADER_BYTES))

    def _set_header(self, slot: int, h: SlotHeader) -> None:
        off = 64 + slot * SLOT_HEADER_BYTES
        # Write everything but the state first, then the state word alone, so a reader never sees
        # PUBLISHED with stale fields.
        SLOT_HEADER.pack_into(self._mm, off, WRITING if h.state == PUBLISHED else h.state, h.generation,
                              h.batch_id, h.payload_len, h.seq, h.checksum, h.flags)
        if h.state == PUBLISHED:
            struct.pack_into("<I", self._mm, off, PUBLISHED)

    def begin_write(self, slot: int, batch_id: int, generation: int, seq: int) -> torch.Tensor:
        """Mark slot ``slot`` WRITING for ``batch_id`` and return its payload view."""
        self._check_slot(slot)
        self._set_header(slot, SlotHeader(WRITING, generation, batch_id, 0, seq, 0, 0))
        return self.payload(slot)

    def publish(self, slot: int, batch_id: int, generation: int, seq: int, payload_len: int,
                checksum: bool = False) -> int:
        """Mark slot ``slot`` PUBLISHED (payload complete); returns the payload CRC32 (0 if not asked).

        The caller must have completed every write (and waited on any asynchronous copy) first.
        """
        self._check_slot(slot)
        if payload_len > self.slot_bytes:
            raise SlotError(f"payload_len {payload_len} exceeds slot_bytes {self.slot_bytes}")
        crc = payload_crc32(self.payload(slot)[:payload_len]) if checksum else 0
        self._set_header(slot, SlotHeader(PUBLISHED, generation, batch_id, payload_len, seq, crc,
                                          FLAG_CHECKSUM if checksum else 0))
        return crc

    def mark_empty(self, slot: int) -> None:
        """Reset slot ``slot``'s header to EMPTY (the coordinator reclaims it)."""
        self._check_slot(slot)
        self._set_header(slot, SlotHeader(EMPTY, 0, -1, 0, 0, 0, 0))

    def verify(self, slot: int, batch_id: int, generation: int, check_crc: bool = True) -> SlotHeader:
        """Check that slot ``slot`` is PUBLISHED for ``batch_id`` by ``generation`` (and its CRC matches).

        Raises ``SlotError`` naming the mismatch.
        """
        h = self.header(slot)
        if h.state != PUBLISHED:
            raise SlotError(f"ring {self.name} slot {slot} is {h.state_name}, not PUBLISHED (batch {batch_id})")
        if h.batch_id != batch_id or h.generation != generation:
            raise SlotError(f"ring {self.name} slot {slot} holds batch {h.batch_id} generation {h.generation}, "
                            f"message says batch {batch_id} generation {generation}")
        if check_crc and h.flags & FLAG_CHECKSUM:
            crc = payload_crc32(self.payload(slot)[:h.payload_len])
            if crc != h.checksum:
                raise SlotError(f"ring {self.name} slot {slot} batch {batch_id}: checksum {crc:#010x} "
                                f"!= header {h.checksum:#010x}")
        return h


def payload_crc32(buf: torch.Tensor) -> int:
    """CRC32 (zlib) of a 1-D ``uint8`` CPU tensor's bytes."""
    return zlib.crc32(memoryview(buf.numpy())) & 0xFFFFFFFF


def list_segments() -> list[str]:
    """Names of every specring segment in ``/dev/shm``."""
    try:
        return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(NAME_PREFIX))
    except FileNotFoundError:
        return []


def _create_locked(path: str) -> int:
    """Create ``path`` (mode 0600, must not exist) and hold a shared ``flock`` on it; returns the descriptor.

    A sweep can see the name between the ``open`` and the lock; if it removed the file in that moment (the
    link count is 0 once we hold the lock), the name is free again and is created anew.
    """
    for _ in range(10):
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            if os.fstat(fd).st_nlink > 0:
                return fd
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
    raise OSError(errno.EAGAIN, f"could not create {path}: something keeps removing it")


def segment_owned(name: str) -> bool:
    """Whether a live process holds segment ``name`` (its creator's ``flock``; see the module docstring).

    False for a name that does not exist. Works across PID namespaces: no pid is involved.
    """
    try:
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def run_owned(run_id: str) -> bool:
    """Whether a live process owns any segment of run ``run_id`` (``segment_owned``): the run is going."""
    prefix = f"{NAME_PREFIX}{run_id}-"
    return any(segment_owned(n) for n in list_segments() if n.startswith(prefix))


def _legacy_creator_alive(path: str, pid: int) -> bool:
    """For segments of older builds, named ``specring-<run>-<pid>-<tag>`` and never locked: whether a process
    with that pid and the recorded start time lives (in this PID namespace; the flaw that locks remove)."""
    start = _process_start_time(pid)
    if start is None:
        return False
    try:
        with open(path, "rb") as f:
            recorded = RING_HEADER.unpack(f.read(RING_HEADER.size))[6]
    except (OSError, struct.error):
        return True  # cannot tell: keep it
    return recorded == 0.0 or abs(start - recorded) < 1.0


def sweep_stale(run_id: str | None = None) -> list[str]:
    """Unlink specring segments that no live process owns; returns the names removed.

    A segment is owned while its creator holds the lock taken in ``Ring.create`` (until ``unlink()`` or the
    creator's exit, SIGKILL included), whatever PID namespace the creator lives in. The sweep takes the lock
    itself before unlinking, so an owned segment is never touched. With ``run_id``, only that run's segments
    are considered. Names that do not parse are left alone; names with a pid (older builds, no lock) are
    removed only once that pid is dead too.
    """
    removed = []
    for name in list_segments():
        m = _NAME_RE.match(name)
        if not m or (run_id is not None and m["run"] != run_id):
            continue
        path = os.path.join(SHM_DIR, name)
        if m["pid"] is not None and _legacy_creator_alive(path, int(m["pid"])):
            continue  # an older build's segment (it takes no lock): judged by its creator's pid, as it was
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if os.stat(path).st_ino != os.fstat(fd).st_ino:
                continue  # replaced since we opened it: not the file whose lock we hold
            os.unlink(path)
            removed.append(name)
            log.info("sweep segment=%s reason=no_owner", name)
        except (BlockingIOError, FileNotFoundError):
            pass  # owned by a live process, or removed by another sweep
        finally:
            os.close(fd)
    return removed


def new_run_id() -> str:
    """A unique run id: 16 hex characters, the start second (so ids sort by time) and 32 random bits.

    No pid is involved: runs in different PID namespaces (all with a supervisor of pid 1) still differ.
    """
    return f"{int(time.time()) & 0xFFFFFFFF:08x}{secrets.token_hex(4)}"
