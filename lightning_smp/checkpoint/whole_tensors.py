"""A sharded checkpoint's tensors read whole, one at a time, in one process (for consolidation and export).

Owns assembling one global tensor from the chunks the ranks wrote, straight from the shard files, and the host
buffers it is assembled in. Not owned: which entries are read and where they go (`consolidation.py`, `export.py`),
checking the files (`verification.py`). DCP's own reader (``dcp.load``) ``torch.load``s each saved chunk, then
copies it into the target: two copies of a tensor at the peak, three when it is cast. Here each chunk's bytes go
from its file into the target directly, or, where the chunk is not contiguous in the target (a tensor-parallel
shard of columns) or the dtype changes, through a buffer of a few rows; the peak is the tensor in its output
dtype plus that buffer. DCP's index (its ``Metadata``) says which file and byte range holds each chunk; each chunk
there is a ``torch.save`` archive of one tensor, whose storage record we locate with ``zipfile``.

Host buffers are anonymous memory maps, given back to the system the moment they are freed: glibc keeps freed
blocks of a few tens of MiB in its heap (allocating and freeing six 30 MiB tensors in turn grew the RSS by 155 MiB).
"""

from __future__ import annotations

import io
import mmap
import struct
import sys
import zipfile
from pathlib import Path
from types import TracebackType

import torch
from torch import Tensor
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

__all__ = ["WholeTensors", "host_empty"]

_PIECE_BYTES = 16 << 20  # the most a row buffer holds (less for smaller tensors: see `_piece_rows`)
_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")  # a zip local file header: 30 bytes, then the name and extra field
_LOCAL_HEADER_SIGNATURE = 0x04034B50


class WholeTensors:
    """Reads the tensor entries of the checkpoint directory ``path`` (with its DCP ``metadata``) whole."""

    def __init__(self, path: Path, metadata: Metadata) -> None:
        self._path = path
        self._metadata = metadata
        self._files: dict[str, io.FileIO] = {}

    def info(self, entry: str) -> TensorStorageMetadata | None:
        """The entry's global shape, dtype and chunks; None for an entry that is not a tensor."""
        info = self._metadata.state_dict_metadata[entry]
        return info if isinstance(info, TensorStorageMetadata) else None

    def read(self, entry: str, dtype: torch.dtype | None = None) -> Tensor:
        """The whole tensor ``entry``, in ``dtype`` (default: as saved), in a buffer of its own."""
        info = self.info(entry)
        assert info is not None, entry
        target = host_empty(info.size, dtype or info.properties.dtype)
        for chunk in info.chunks:
            region = target
            for dim, (offset, size) in enumerate(zip(chunk.offsets, chunk.sizes, strict=True)):
                region = region.narrow(dim, offset, size)
            self._read_chunk(entry, chunk, region)
        return target

    def _read_chunk(self, entry: str, chunk: ChunkStorageMetadata, region: Tensor) -> None:
        where = self._metadata.storage_data[MetadataIndex(entry, chunk.offsets)]
        stream = self._open(where.relative_path)
        item = _Slice(stream, where.offset, where.length)
        stored, start = _locate_storage(item)
        if start is None:  # not a plain contiguous tensor (never written so by us): torch reads it, then we copy
            region.copy_(torch.load(io.BufferedReader(item.fresh()), map_location="cpu", weights_only=True))
            return
        start += where.offset
        if region.is_contiguous() and region.dtype == stored.dtype:
            _read_into(stream, start, _bytes_of(region))
            return
        rows = region if region.dim() else region.view(1)  # (R, ...) in the target's layout
        row_bytes = rows[0].numel() * stored.element_size()
        step = _piece_rows(rows, row_bytes)
        buffer = host_empty((step, *rows.shape[1:]), stored.dtype)
        for first in range(0, rows.shape[0], step):
            count = min(step, rows.shape[0] - first)
            piece = buffer[:count]
            _read_into(stream, start + first * row_bytes, _bytes_of(piece))
            rows[first : first + count].copy_(piece)  # casts when the dtypes differ

    def _open(self, relative_path: str) -> io.FileIO:
        stream = self._files.get(relative_path)
        if stream is None:
            stream = self._files[relative_path] = open(self._path / relative_path, "rb", buffering=0)  # noqa: SIM115
        return stream

    def close(self) -> None:
        for stream in self._files.values():
            stream.close()
        self._files.clear()

    def __enter__(self) -> WholeTensors:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()


def host_empty(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> Tensor:
    """An uninitialised CPU tensor in an anonymous memory map of its own (unmapped when the tensor is freed)."""
    numel = 1
    for size in shape:
        numel *= size
    nbytes = numel * dtype.itemsize
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype, count=numel).view(shape)


def _locate_storage(item: _Slice) -> tuple[Tensor, int | None]:
    """The stored tensor (on the meta device: its dtype, shape and strides) and where, in ``item``, its bytes start
    in row-major order; None as the start when they cannot be read as they lie (a view, another byte order)."""
    stored = torch.load(io.BufferedReader(item.fresh()), map_location="meta", weights_only=True)  # closes its copy
    with zipfile.ZipFile(item) as archive:
        records = [info for info in archive.infolist() if info.filename.rsplit("/", 2)[-2:-1] == ["data"]]
        byteorder = next((archive.read(i) for i in archive.infolist() if i.filename.endswith("/byteorder")), None)
    plain = stored.is_contiguous() and stored.storage_offset() == 0 and byteorder in (None, sys.byteorder.encode())
    if len(records) != 1 or records[0].compress_type != zipfile.ZIP_STORED or not plain:
        return stored, None
    record = records[0]
    if record.file_size != stored.numel() * stored.element_size():
        return stored, None
    item.seek(record.header_offset)
    header = _LOCAL_HEADER.unpack(item.read(_LOCAL_HEADER.size))
    if header[0] != _LOCAL_HEADER_SIGNATURE:
        return stored, None
    name_length, extra_length = header[9], header[10]
    return stored, record.header_offset + _LOCAL_HEADER.size + name_length + extra_length


def _piece_rows(rows: Tensor, row_bytes: int) -> int:
    """Rows per buffer: at most `_PIECE_BYTES` and a sixteenth of the chunk, at least one row."""
    limit = min(_PIECE_BYTES, rows.shape[0] * row_bytes // 16)
    return max(1, min(rows.shape[0], limit // max(row_bytes, 1)))


def _bytes_of(tensor: Tensor) -> memoryview:
    """A writable view of a contiguous CPU tensor's bytes."""
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy()).cast("B")


def _read_into(stream: io.FileIO, position: int, view: memoryview) -> None:
    stream.seek(position)
    done = 0
    while done < len(view):
        count = stream.readinto(view[done:])
        if not count:
            raise OSError(
                f"{stream.name}: the file ends {len(view) - done} bytes early (cut short after the checkpoint's "
                "checks ran); use an earlier checkpoint"
            )
        done += count


class _Slice(io.RawIOBase):
    """The byte range ``[offset, offset + length)`` of an open file, as a seekable read-only file of its own."""

    def __init__(self, stream: io.FileIO, offset: int, length: int) -> None:
        super().__init__()
        self._stream, self._offset, self._length, self._position = stream, offset, length, 0

    def fresh(self) -> _Slice:
        """Another reader of the same range, from its start (a ``BufferedReader`` closes the reader it wraps)."""
        return _Slice(self._stream, self._offset, self._length)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self._length}[whence]
        self._position = max(0, base + offset)
        return self._position

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        count = max(0, min(len(buffer), self._length - self._position))
        if count == 0:
            return 0
        self._stream.seek(self._offset + self._position)
        count = self._stream.readinto(memoryview(buffer)[:count]) or 0
        self._position += count
        return count
