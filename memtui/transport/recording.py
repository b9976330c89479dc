"""The recording format (``.mtrec``): what a viewer saw, written to a file and read back.

The hook writes one (``install(record=...)``), so does :func:`memtui.transport.sources.record`, and
:class:`memtui.transport.sources.ReplaySource` replays one; this module is the format alone (no ZeroMQ),
small on purpose::

    file    := MAGIC record*
    MAGIC   := the 8 bytes b"MTREC01\\n"
    record  := length (4 bytes, unsigned, big-endian) + that many bytes of msgpack
    first record:  a map (RecordingHeader): format version, wall time the recording started,
                   run id, source and a free-text note
    every other:   an array (RecordedFrame) [offset_s, rank, frame]: seconds since the start,
                   the rank that published it (-1: a snapshot from the control socket), and
                   the raw wire frame exactly as received (or, for snapshots, as re-encoded)

Nothing here imports torch, Textual or ZeroMQ: the training process writes recordings too.
"""

from __future__ import annotations

import itertools
import os
import stat
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import msgspec

from memtui.storage import ownfiles
from memtui.wire import Decoder, Message

MAGIC = b"MTREC01\n"
"""The first bytes of every recording."""
FORMAT_VERSION = 1
CONTROL_RANK = -1
"""The rank recorded for frames that came from the control socket (snapshots)."""
MAX_RECORD = 64 << 20
"""A record longer than this is taken for corruption."""


class RecordingError(ValueError):
    """A file that is not a recording, or a damaged one."""


class RecordingHeader(msgspec.Struct, omit_defaults=True):
    """The first record of a recording."""

    format: int = FORMAT_VERSION
    started: float = 0.0
    """Wall time (``time.time()``) at offset 0."""
    run: str = ""
    source: str = ""
    """What was recorded: the control endpoint, or the script that synthesised the stream."""
    note: str = ""


class RecordedFrame(msgspec.Struct, array_like=True, frozen=True):
    """One recorded frame."""

    offset_s: float
    rank: int
    frame: bytes


@dataclass
class Recording:
    """A recording read into memory."""

    header: RecordingHeader
    frames: list[RecordedFrame]
    cut_at: int | None = None
    """The byte where the whole frames end and a cut or damaged tail begins (None: whole)."""
    size: int = 0
    """The file's size in bytes."""
    limited: bool = False
    """The file is larger than ``MAX_RECORDING``: only its first bytes were read."""

    @property
    def cut_note(self) -> str:
        """Where the recording is cut, in one line ("" when it is whole)."""
        if self.limited:
            return (
                f"the recording is {self.size} bytes, more than the {MAX_RECORDING >> 20} MiB "
                f"memtui reads: replaying its first {len(self.frames)} whole frames, "
                f"{self.duration_s:.1f} s"
            )
        if self.cut_at is None:
            return ""
        return (
            f"the recording is cut at byte {self.cut_at} of {self.size} (a run killed while "
            f"writing, or bytes appended): replaying its {len(self.frames)} whole frames, "
            f"{self.duration_s:.1f} s"
        )

    @property
    def duration_s(self) -> float:
        """The offset of the last frame."""
        return self.frames[-1].offset_s if self.frames else 0.0

    def offset_of(self, predicate: Callable[[Message], bool]) -> float | None:
        """The offset of the first frame whose message satisfies ``predicate`` (None: none)."""
        decoder = Decoder()
        for frame in self.frames:
            message = decoder.decode(frame.frame)
            if message is not None and predicate(message):
                return frame.offset_s
        return None


FLUSH_S = 1.0
"""The writer flushes at least this often (each frame is written; no fsync)."""
_LENGTH = struct.Struct(">I")
_encoder = msgspec.msgpack.Encoder()
_header_decoder = msgspec.msgpack.Decoder(RecordingHeader)
_frame_decoder = msgspec.msgpack.Decoder(RecordedFrame)


class RecordingWriter:
    """Writes a recording, the user's own 0600 file (``ownfiles.open_write``): the header
    first, then frames in time order."""

    def __init__(self, path: str | os.PathLike[str], header: RecordingHeader) -> None:
        self.path = Path(path)
        self.header = header
        self.frames = 0
        # 0600 and never through a link: it holds the command line, the cwd and paths
        self._file: BinaryIO = open(ownfiles.open_write(self.path), "wb")  # noqa: SIM115
        self._file.write(MAGIC)
        self._write(_encoder.encode(header))
        self._file.flush()
        self._flushed = time.monotonic()

    def _write(self, payload: bytes) -> None:
        self._file.write(_LENGTH.pack(len(payload)))
        self._file.write(payload)

    def write(self, offset_s: float, rank: int, frame: bytes) -> None:
        """Append one frame ``offset_s`` seconds after the start (flushed at least once a
        second, so a killed run loses at most the last second)."""
        self._write(_encoder.encode(RecordedFrame(round(offset_s, 4), rank, bytes(frame))))
        self.frames += 1
        now = time.monotonic()
        if now - self._flushed >= FLUSH_S:
            self._flushed = now
            self._file.flush()

    def close(self) -> None:
        """Flush and close the file."""
        self._file.close()

    def __enter__(self) -> RecordingWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _split(data: bytes) -> tuple[list[bytes], int | None]:
    """The whole records of a recording, and the byte where it is cut (None: it is whole)."""
    if not data.startswith(MAGIC):
        raise RecordingError("not a memtui recording (bad magic)")
    records: list[bytes] = []
    pos = len(MAGIC)
    while pos < len(data):
        if pos + 4 > len(data):
            return records, pos
        (length,) = _LENGTH.unpack_from(data, pos)
        if length > MAX_RECORD or pos + 4 + length > len(data):
            return records, pos
        records.append(data[pos + 4 : pos + 4 + length])
        pos += 4 + length
    return records, None


MAX_RECORDING = 1 << 30
"""Bytes of a recording read at most (frames beyond are not replayed, and that is said)."""


def read_recording(path: str | os.PathLike[str]) -> Recording:
    """Read a recording: every whole frame (of its first ``MAX_RECORDING`` bytes), and where the
    file is cut if it is (a run killed while writing, or bytes appended); raise RecordingError
    if it is not one at all, or not a regular file (a FIFO or a device would block the reader or
    never end)."""
    data, size = _read_bounded(Path(path))
    limited = size > MAX_RECORDING
    records, cut_at = _split(data)
    if not records:
        raise RecordingError("empty recording: no header")
    try:
        header = _header_decoder.decode(records[0])
    except msgspec.DecodeError as exc:
        raise RecordingError(f"bad header: {exc}")
    if header.format != FORMAT_VERSION:
        raise RecordingError(f"recording format {header.format}, expected {FORMAT_VERSION}")
    frames: list[RecordedFrame] = []
    offsets = itertools.accumulate([len(MAGIC), *(4 + len(r) for r in records)])
    for record, start in zip(records[1:], list(offsets)[1:], strict=False):
        try:
            frames.append(_frame_decoder.decode(record))
        except msgspec.DecodeError:
            cut_at = start
            break
    return Recording(header, frames, cut_at, size, limited)


def _read_bounded(path: Path) -> tuple[bytes, int]:
    """The first ``MAX_RECORDING`` bytes of the regular file ``path``, and its size."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    with open(fd, "rb") as handle:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise RecordingError(f"{path} is not a regular file: refused")
        data = handle.read(MAX_RECORDING)
    return data, max(info.st_size, len(data))
