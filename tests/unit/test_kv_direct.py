"""``O_DIRECT`` block files: the same bytes and the same guarantees as buffered ones, at sizes
around the bounce buffer's chunk and into unaligned destinations."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from dualpath.kv import HEADER_BYTES, BlockStore, CorruptBlockError, model_digest
from dualpath.kv.direct import ALIGN, CHUNK_BYTES, open_direct

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
    [1, ALIGN - HEADER_BYTES, ALIGN, CHUNK_BYTES - HEADER_BYTES, CHUNK_BYTES, CHUNK_BYTES + 1, 2 * CHUNK_BYTES + 12345],
)
def test_direct_files_equal_buffered_ones_and_read_back_into_an_unaligned_buffer(stores: tuple[BlockStore, BlockStore], size: int) -> None:
    buffered, direct = stores
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    for store in stores:
        assert store.write(model_digest=DIGEST, block_hash=7, payload=data, **_shape(size)) == HEADER_BYTES + size  # type: ignore[arg-type]
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
        f.seek(HEADER_BYTES + CHUNK_BYTES + 17)
        f.write(b"\x01")
    with pytest.raises(CorruptBlockError, match="checksum"):
        direct.read_into(model_digest=DIGEST, block_hash=9, dest=bytearray(size), **_shape(size))  # type: ignore[arg-type]
