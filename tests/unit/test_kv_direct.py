"""``O_DIRECT`` block files: the same bytes and the same guarantees as buffered ones, at sizes
around the bounce buffer's chunk, into unaligned destinations (the bounce buffer) and into
aligned ones (straight into the slot)."""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from dualpath.kv import PAYLOAD_OFFSET, BlockStore, CorruptBlockError, model_digest, storage
from dualpath.kv.direct import ALIGN, CHUNK_BYTES, WRITE_CHUNK_BYTES, open_direct, read_aligned

DIGEST = model_digest("direct-test")


def _direct_ok(root: Path) -> bool:
    probe = root / "probe"
    fd = open_direct(probe, os.O_WRONLY | os.O_CREAT)
    if fd is None:
        return False
    os.close(fd)
    probe.unlink()
    return True


@pytest.fixture
def stores(tmp_path: Path) -> tuple[BlockStore, BlockStore]:
    if not _direct_ok(tmp_path):
        pytest.skip("the test's filesystem has no O_DIRECT")
    return BlockStore(tmp_path / "buffered"), BlockStore(tmp_path / "direct", direct=True)


def _shape(size: int) -> dict[str, object]:
    return dict(layers=1, tokens=1, bytes_per_token_layer=size, dtype="uint8")


@pytest.mark.parametrize(
    "size",
    [1, ALIGN - 1, ALIGN, CHUNK_BYTES - PAYLOAD_OFFSET, CHUNK_BYTES, CHUNK_BYTES + 1, 2 * CHUNK_BYTES + 12345],
)
def test_direct_files_equal_buffered_ones_and_read_back_into_an_unaligned_buffer(stores: tuple[BlockStore, BlockStore], size: int) -> None:
    buffered, direct = stores
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    for store in stores:
        assert store.write(model_digest=DIGEST, block_hash=7, payload=data, **_shape(size)) == PAYLOAD_OFFSET + size  # type: ignore[arg-type]
    assert direct.path_for(DIGEST, 7).read_bytes() == buffered.path_for(DIGEST, 7).read_bytes()
    dest = bytearray(size + 3)
    for store in stores:
        view = memoryview(dest)[3:]  # not aligned to anything
        assert store.read_into(model_digest=DIGEST, block_hash=7, dest=view, **_shape(size)) == size  # type: ignore[arg-type]
        assert bytes(view) == data


def test_a_direct_read_of_a_file_torn_past_the_first_chunk_is_corrupt(stores: tuple[BlockStore, BlockStore]) -> None:
    _, direct = stores
    size = CHUNK_BYTES + ALIGN
    direct.write(model_digest=DIGEST, block_hash=8, payload=bytes(size), **_shape(size))  # type: ignore[arg-type]
    os.truncate(direct.path_for(DIGEST, 8), CHUNK_BYTES + 100)
    with pytest.raises(CorruptBlockError, match="file is"):
        direct.read_into(model_digest=DIGEST, block_hash=8, dest=bytearray(size), **_shape(size))  # type: ignore[arg-type]


def test_a_direct_read_catches_a_flipped_payload_byte_in_a_later_chunk(stores: tuple[BlockStore, BlockStore]) -> None:
    _, direct = stores
    size = 2 * CHUNK_BYTES
    direct.write(model_digest=DIGEST, block_hash=9, payload=bytes(size), **_shape(size))  # type: ignore[arg-type]
    with open(direct.path_for(DIGEST, 9), "r+b") as f:
        f.seek(PAYLOAD_OFFSET + CHUNK_BYTES + 17)
        f.write(b"\x01")
    with pytest.raises(CorruptBlockError, match="checksum"):
        direct.read_into(model_digest=DIGEST, block_hash=9, dest=bytearray(size), **_shape(size))  # type: ignore[arg-type]


def _slot_buffer(nbytes: int) -> memoryview:
    """A page-aligned buffer, as a node buffer's slots are, filled with a sentinel."""
    view = memoryview(mmap.mmap(-1, nbytes))
    view[:] = b"\xee" * nbytes
    return view


@pytest.mark.parametrize("size", [PAYLOAD_OFFSET, 3 * PAYLOAD_OFFSET + 512, 10_000, 2 * CHUNK_BYTES + 1])
def test_an_aligned_direct_read_lands_in_the_slot_and_writes_nothing_past_its_end(
    stores: tuple[BlockStore, BlockStore], monkeypatch: pytest.MonkeyPatch, size: int
) -> None:
    """No bounce buffer for the payload (``read_direct`` is not called), and a payload that is
    not a whole number of sectors gets its tail without the bytes after the slot changing."""
    _, direct = stores
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    direct.write(model_digest=DIGEST, block_hash=10, payload=data, **_shape(size))  # type: ignore[arg-type]

    def no_bounce(*args: object) -> int:
        raise AssertionError("an aligned destination went through the bounce buffer")

    monkeypatch.setattr(storage, "read_direct", no_bounce)
    monkeypatch.setattr(storage, "IN_PLACE_MIN_BYTES", 0)  # small blocks take the same path
    buf = _slot_buffer(2 * ALIGN + size + ALIGN)
    slot = buf[2 * ALIGN : 2 * ALIGN + size]
    assert direct.read_into(model_digest=DIGEST, block_hash=10, dest=slot, **_shape(size)) == size  # type: ignore[arg-type]
    assert bytes(slot) == data
    assert bytes(buf[: 2 * ALIGN]) == b"\xee" * 2 * ALIGN
    assert bytes(buf[2 * ALIGN + size :]) == b"\xee" * ALIGN


def test_a_block_at_a_sector_but_not_a_page_boundary_is_read_in_place(stores: tuple[BlockStore, BlockStore]) -> None:
    """The bundled targets' blocks are multiples of 512 bytes, not of 4 KiB: every other block
    of a slot starts mid-page, which is aligned enough where the filesystem asks for 512."""
    _, direct = stores
    size = 256 * ALIGN + 2048  # a 1,259,520-byte block's remainder modulo 4 KiB
    data = bytes(range(256)) * (size // 256)
    direct.write(model_digest=DIGEST, block_hash=11, payload=data, **_shape(size))  # type: ignore[arg-type]
    buf = _slot_buffer(2 * size + ALIGN)
    for i in range(2):
        dest = buf[i * size : (i + 1) * size]
        assert direct.read_into(model_digest=DIGEST, block_hash=11, dest=dest, **_shape(size)) == size  # type: ignore[arg-type]
        assert bytes(dest) == data
    assert bytes(buf[2 * size :]) == b"\xee" * ALIGN


def test_a_filesystem_that_wants_more_alignment_than_it_said_falls_back_to_the_bounce_buffer(
    stores: tuple[BlockStore, BlockStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``EINVAL`` from an aligned read or write is not an error: the block goes through the
    bounce buffer (and its checksum is taken once)."""
    buffered, direct = stores
    monkeypatch.setattr(storage, "dio_alignment", lambda fd: 1)  # every address "aligned"
    bounced: list[str] = []

    def spy(name: str) -> Callable[..., object]:
        real = getattr(storage, name)

        def call(*args: object) -> object:
            bounced.append(name)
            return real(*args)

        return call

    for name in ("read_direct", "write_direct"):
        monkeypatch.setattr(storage, name, spy(name))
    size = 2 * ALIGN
    data = bytes(range(256)) * (size // 256)
    src = bytearray(size + 1)
    src[1:] = data
    assert direct.write(model_digest=DIGEST, block_hash=12, payload=memoryview(src)[1:], **_shape(size)) == PAYLOAD_OFFSET + size  # type: ignore[arg-type]
    buffered.write(model_digest=DIGEST, block_hash=12, payload=data, **_shape(size))  # type: ignore[arg-type]
    assert direct.path_for(DIGEST, 12).read_bytes() == buffered.path_for(DIGEST, 12).read_bytes()
    monkeypatch.setattr(direct, "_dio_align", None)
    monkeypatch.setattr(storage, "IN_PLACE_MIN_BYTES", 0)
    dest = memoryview(bytearray(size + 1))[1:]
    assert direct.read_into(model_digest=DIGEST, block_hash=12, dest=dest, **_shape(size)) == size  # type: ignore[arg-type]
    assert bytes(dest) == data
    assert bounced == ["write_direct", "read_direct"]


@pytest.mark.parametrize("cut", [PAYLOAD_OFFSET - 1, PAYLOAD_OFFSET, PAYLOAD_OFFSET + ALIGN, PAYLOAD_OFFSET + 5 * ALIGN - 1])
def test_a_torn_version_2_file_is_a_miss_on_the_aligned_path(
    stores: tuple[BlockStore, BlockStore], monkeypatch: pytest.MonkeyPatch, cut: int
) -> None:
    """Cut anywhere (in the header page, at the payload, mid-payload, a byte short), a file is
    refused before its payload is used: by its size, and by the read itself if it is cut
    between the size check and the read."""
    _, direct = stores
    monkeypatch.setattr(storage, "IN_PLACE_MIN_BYTES", 0)
    size = 5 * ALIGN
    direct.write(model_digest=DIGEST, block_hash=13, payload=bytes(range(256)) * (size // 256), **_shape(size))  # type: ignore[arg-type]
    path = direct.path_for(DIGEST, 13)
    os.truncate(path, cut)
    with pytest.raises(CorruptBlockError):
        direct.read_into(model_digest=DIGEST, block_hash=13, dest=_slot_buffer(size), **_shape(size))  # type: ignore[arg-type]
    fd = open_direct(path, os.O_RDONLY)
    assert fd is not None
    heads: list[int] = []
    try:
        landed = read_aligned(fd, PAYLOAD_OFFSET, _slot_buffer(size), 512, lambda raw: heads.append(len(raw)), lambda data: None)
    finally:
        os.close(fd)
    assert landed == max(0, cut - PAYLOAD_OFFSET) < size
    assert heads == ([PAYLOAD_OFFSET] if cut >= PAYLOAD_OFFSET else [])


@pytest.mark.parametrize("size", [ALIGN, WRITE_CHUNK_BYTES + 512 + 100, 3 * WRITE_CHUNK_BYTES])
def test_an_aligned_direct_write_leaves_from_the_slot_and_equals_a_buffered_one(
    stores: tuple[BlockStore, BlockStore], monkeypatch: pytest.MonkeyPatch, size: int
) -> None:
    """Chunk by chunk from the caller's buffer, a partial last sector padded and cut off, the
    header last: the file is byte for byte the buffered one."""
    buffered, direct = stores
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()

    def no_bounce(*args: object) -> None:
        raise AssertionError("an aligned source went through the bounce buffer")

    monkeypatch.setattr(storage, "write_direct", no_bounce)
    slot = _slot_buffer(size + ALIGN)[:size]
    slot[:] = data
    assert direct.write(model_digest=DIGEST, block_hash=14, payload=slot, **_shape(size)) == PAYLOAD_OFFSET + size  # type: ignore[arg-type]
    buffered.write(model_digest=DIGEST, block_hash=14, payload=data, **_shape(size))  # type: ignore[arg-type]
    assert direct.path_for(DIGEST, 14).read_bytes() == buffered.path_for(DIGEST, 14).read_bytes()


def test_a_block_below_the_in_place_size_is_read_through_the_bounce_buffer(
    stores: tuple[BlockStore, BlockStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, direct = stores
    size = storage.IN_PLACE_MIN_BYTES - ALIGN
    data = bytes(range(256)) * (size // 256)
    direct.write(model_digest=DIGEST, block_hash=15, payload=data, **_shape(size))  # type: ignore[arg-type]
    monkeypatch.setattr(storage, "read_aligned", lambda *args: pytest.fail("read in place"))
    slot = _slot_buffer(size)
    assert direct.read_into(model_digest=DIGEST, block_hash=15, dest=slot, **_shape(size)) == size  # type: ignore[arg-type]
    assert bytes(slot) == data
