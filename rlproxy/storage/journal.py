"""The crash journal: every captured completion is appended to a local file before the client gets
its last byte, and replayed into the store when the proxy starts again.

Why: the writer commits in batches (`flush_interval`), so a `kill -9` would lose the records of the
last window although their clients already got the whole response. An `os.write` to a file is kept
by the kernel even if the process dies the next instant, and costs a few microseconds, so the hot
path pays one small write per completion and no fsync.

Layout: a folder of segment files `<ns>-<pid>.seg`, appended to in order. A frame is

    <u32 little-endian length> <u32 crc32 of the payload> <payload: the record as orjson>

A segment is rotated past `segment_bytes` and deleted once every record in it is resolved
(committed, or dropped as unstorable). Each process holds an exclusive `flock` on the segments it
has open, so a starting process replays only segments whose owner is gone (several proxies may share
a folder). A torn last frame (the process died inside `write`) fails its CRC and is ignored: its
response had not been sent yet.

What is still lost: an OS crash or power cut can lose the journal's unsynced pages (seconds of
records, like SQLite's `synchronous=NORMAL` commits); a full journal (`max_bytes`) stops journaling
until records are committed (counted in `skipped`).
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import logging
import os
import struct
import time
import zlib
from datetime import datetime
from pathlib import Path

import orjson
from sqlalchemy.engine import make_url

from rlproxy.storage.db import is_sqlite, json_bytes, normalize_url, sqlite_path
from rlproxy.storage.records import CompletionRecord

log = logging.getLogger(__name__)

_HEAD = struct.Struct("<II")  # payload length, crc32
_FIELDS = tuple(f.name for f in dataclasses.fields(CompletionRecord))


def default_folder(db_url: str, cache_dir: str | Path) -> Path | None:
    """Where the journal of `db_url` lives: `<db file>.journal` next to a SQLite file, else a
    folder per database under `cache_dir`; None for an in-memory database (nothing to replay into)."""
    if is_sqlite(db_url):
        path = sqlite_path(db_url)
        return Path(path + ".journal") if path else None
    key = make_url(normalize_url(db_url)).render_as_string(hide_password=True)
    return Path(cache_dir).expanduser() / "journal" / hashlib.sha256(key.encode()).hexdigest()[:16]


def encode(rec: CompletionRecord) -> bytes:
    """The record as one JSON document (raises TypeError for values JSON cannot hold)."""
    return json_bytes(rec)


def decode(payload: bytes) -> CompletionRecord:
    """The record `encode` wrote (non-finite floats come back as null, as the store keeps them)."""
    data = orjson.loads(payload)
    try:  # what `encode` of this version wrote: every field, passed by position (by keyword, each
        # of the parser's key strings is compared by value with every parameter name: ~6 us a
        # record, a third of the writer process's decode; issue 24)
        rec = CompletionRecord(*[data[k] for k in _FIELDS])
    except KeyError:  # another version's record: the fields both know
        rec = CompletionRecord(**{k: data[k] for k in _FIELDS if k in data})
    if isinstance(rec.created_at, str):
        try:
            rec.created_at = datetime.fromisoformat(rec.created_at)
        except ValueError:  # as submitted: the store refuses it, and it is kept as an error row
            pass
    return rec


class Segment:
    """One journal file: its open descriptor (holding the lock), size and unresolved records."""

    def __init__(self, path: Path, fd: int, size: int = 0) -> None:
        self.path = path
        self.fd = fd
        self.size = size
        self.pending = 0  # records appended (or replayed from it) and not yet resolved
        self.sealed = False  # no more appends: deleted when `pending` reaches 0


class Journal:
    """Append-only segments in `folder`; `append` on the hot path, `resolve` from the writer."""

    def __init__(self, folder: str | Path, max_bytes: int = 1 << 30, segment_bytes: int = 16 << 20) -> None:
        self.folder = Path(folder)
        self.max_bytes = max_bytes
        self.segment_bytes = max(4096, min(segment_bytes, max_bytes // 4 or 4096))
        self.size = 0  # bytes in segments this process holds (live and adopted)
        self.skipped = 0  # records not journaled because the journal was full or they cannot be encoded
        self._active: Segment | None = None
        self._segments: set[Segment] = set()
        self._closed = False

    # -- hot path -------------------------------------------------------------------------------

    def append(self, payload: bytes) -> Segment | None:
        """Write one frame; the segment that holds it, or None when it was not journaled."""
        if self._closed:
            return None
        if self.size + len(payload) + _HEAD.size > self.max_bytes:
            self.skipped += 1
            if self.skipped == 1 or self.skipped % 1000 == 0:
                log.warning("journal full (%d bytes): %d records not journaled", self.size, self.skipped)
            return None
        seg = self._active
        if seg is None or seg.size >= self.segment_bytes:
            seg = self._rotate()
        frame = _HEAD.pack(len(payload), zlib.crc32(payload)) + payload
        os.write(seg.fd, frame)  # O_APPEND; a regular file: no short writes short of a full disk
        seg.size += len(frame)
        self.size += len(frame)
        seg.pending += 1
        return seg

    def resolve(self, seg: Segment) -> None:
        """A record of `seg` is committed or given up on; delete the segment when it was the last."""
        seg.pending -= 1
        if seg.pending <= 0 and seg.sealed:
            self._delete(seg)

    # -- start and stop -------------------------------------------------------------------------

    def recover(self) -> list[tuple[Segment, list[CompletionRecord]]]:
        """Adopt the segments of dead processes (blocking file I/O: call it in a thread).

        Returns each adopted segment with its records in order; the caller resolves every record
        once it is stored, which deletes the segment.
        """
        self.folder.mkdir(parents=True, exist_ok=True)
        out: list[tuple[Segment, list[CompletionRecord]]] = []
        for path in sorted(self.folder.glob("*.seg")):
            try:
                fd = os.open(path, os.O_RDWR)
            except FileNotFoundError:  # another process finished it meanwhile
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # its process is alive
                os.close(fd)
                continue
            data = path.read_bytes()
            records, used = _frames(data)
            if used < len(data):
                log.warning("journal %s: ignored a torn tail of %d bytes", path.name, len(data) - used)
            seg = Segment(path, fd, len(data))
            seg.sealed = True
            seg.pending = len(records)
            self._segments.add(seg)
            self.size += seg.size
            if records:
                out.append((seg, records))
            else:
                self._delete(seg)
        return out

    def close(self) -> None:
        """Seal everything; segments with unresolved records stay on disk for the next start."""
        self._closed = True
        for seg in list(self._segments):
            seg.sealed = True
            if seg.pending <= 0:
                self._delete(seg)
            else:
                os.close(seg.fd)
                self._segments.discard(seg)
                log.warning("journal %s keeps %d unstored records for the next start", seg.path, seg.pending)
        self._active = None

    # -- internals ------------------------------------------------------------------------------

    def _rotate(self) -> Segment:
        old = self._active
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"{time.time_ns():020d}-{os.getpid()}.seg"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_EXCL, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        seg = self._active = Segment(path, fd)
        self._segments.add(seg)
        if old is not None:
            old.sealed = True
            if old.pending <= 0:
                self._delete(old)
        return seg

    def _delete(self, seg: Segment) -> None:
        if seg not in self._segments:
            return
        self._segments.discard(seg)
        self.size -= seg.size
        try:
            seg.path.unlink(missing_ok=True)  # unlink first: the lock is held until then
        finally:
            os.close(seg.fd)
        if seg is self._active:
            self._active = None


def _frames(data: bytes) -> tuple[list[CompletionRecord], int]:
    """The records of a segment's bytes, up to the first torn or corrupt frame; bytes consumed."""
    records: list[CompletionRecord] = []
    pos = 0
    while pos + _HEAD.size <= len(data):
        n, crc = _HEAD.unpack_from(data, pos)
        end = pos + _HEAD.size + n
        payload = data[pos + _HEAD.size : end]
        if end > len(data) or zlib.crc32(payload) != crc:
            break
        try:
            records.append(decode(payload))
        except (ValueError, TypeError) as exc:  # a record of an older or newer version: skip it
            log.error("journal: skipping an unreadable record: %s", exc)
        pos = end
    return records, pos
