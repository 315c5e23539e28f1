"""BlockStore: atomic, verified Full Block files under a storage root."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dualpath.kv import PAYLOAD_OFFSET, BlockMissingError, BlockStore, CorruptBlockError, hash_hex, model_digest
from dualpath.kv.direct import PIECE_BYTES

DIGEST = model_digest("test-model")
LAYERS, TOKENS, BPT = 4, 64, 32
SHAPE = dict(layers=LAYERS, tokens=TOKENS, bytes_per_token_layer=BPT, dtype="bfloat16")
PAYLOAD_BYTES = LAYERS * TOKENS * BPT


def payload(seed: int = 0, size: int = PAYLOAD_BYTES) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


@pytest.fixture(params=[False, True], ids=["buffered", "direct"])
def store(tmp_path: Path, request: pytest.FixtureRequest) -> BlockStore:
    """Every test runs on buffered and on ``O_DIRECT`` I/O (buffered where the filesystem has no direct I/O)."""
    return BlockStore(tmp_path / "kv", direct=request.param)


def put(store: BlockStore, data: bytes, block_hash: int = 0xB10C, **shape: object) -> int:
    fields = {**SHAPE, **shape, "payload": data}
    return store.write(model_digest=DIGEST, block_hash=block_hash, **fields)  # type: ignore


def read(
    store: BlockStore,
    block_hash: int = 0xB10C,
    digest: int = DIGEST,
    dest: object = None,
    **shape: object,
) -> bytearray:
    dest = bytearray(PAYLOAD_BYTES) if dest is None else dest
    fields = {**SHAPE, **shape}
    store.read_into(model_digest=digest, block_hash=block_hash, dest=dest, **fields)  # type: ignore
    return dest  # type: ignore[return-value]


def test_written_block_reads_back_byte_for_byte(store: BlockStore) -> None:
    data = payload(1)
    written = put(store, data)
    assert written == PAYLOAD_OFFSET + PAYLOAD_BYTES
    assert store.path_for(DIGEST, 0xB10C).stat().st_size == written
    assert bytes(read(store)) == data
    assert store.exists(DIGEST, 0xB10C)
    assert store.usage_bytes() == written


def test_path_is_derived_from_the_hashes_only(store: BlockStore) -> None:
    path = store.path_for(DIGEST, 0x0123456789ABCDEF)
    assert path == store.root / hash_hex(DIGEST) / "01" / "23" / "0123456789abcdef.kvb"
    with pytest.raises(ValueError):
        store.path_for(DIGEST, -1)


def test_layer_block_is_a_contiguous_slice_of_the_payload(store: BlockStore) -> None:
    layers = [bytes([i]) * (TOKENS * BPT) for i in range(LAYERS)]  # [layers, tokens, bytes]
    put(store, b"".join(layers))
    dest = read(store)
    for i, layer in enumerate(layers):
        assert dest[i * TOKENS * BPT : (i + 1) * TOKENS * BPT] == layer


def test_read_lands_in_a_typed_numpy_buffer(store: BlockStore) -> None:
    data = payload(2)
    put(store, data)
    dest = np.zeros((LAYERS, TOKENS, BPT // 2), dtype=np.float16)  # [layers, tokens, elems]
    read(store, dest=memoryview(dest))
    assert dest.tobytes() == data


def test_missing_block_raises_block_missing_error(store: BlockStore) -> None:
    with pytest.raises(BlockMissingError) as info:
        read(store)
    assert info.value.path == store.path_for(DIGEST, 0xB10C)


@pytest.mark.parametrize("cut", [1, PAYLOAD_BYTES, PAYLOAD_BYTES + PAYLOAD_OFFSET - 10])
def test_truncated_file_is_corrupt(store: BlockStore, cut: int) -> None:
    put(store, payload())
    path = store.path_for(DIGEST, 0xB10C)
    os.truncate(path, path.stat().st_size - cut)
    with pytest.raises(CorruptBlockError):
        read(store)


def test_trailing_garbage_is_corrupt(store: BlockStore) -> None:
    put(store, payload())
    with open(store.path_for(DIGEST, 0xB10C), "ab") as f:
        f.write(b"x")
    with pytest.raises(CorruptBlockError, match="bytes"):
        read(store)


@pytest.mark.parametrize("offset", [0, PAYLOAD_BYTES // 2, PAYLOAD_BYTES - 1])
def test_flipped_payload_byte_is_corrupt(store: BlockStore, offset: int) -> None:
    put(store, payload())
    path = store.path_for(DIGEST, 0xB10C)
    raw = bytearray(path.read_bytes())
    raw[PAYLOAD_OFFSET + offset] ^= 0x40
    path.write_bytes(raw)
    with pytest.raises(CorruptBlockError, match="checksum"):
        read(store)


@pytest.mark.parametrize("offset", [0, PIECE_BYTES - 1, PIECE_BYTES, 2 * PIECE_BYTES + 5, 3 * PIECE_BYTES + 122])
def test_a_block_of_several_pieces_is_checksummed_whole(store: BlockStore, offset: int) -> None:
    """Reads land and are checksummed piece by piece; every piece counts, the last short one too."""
    size = 3 * PIECE_BYTES + 123
    data = payload(5, size)
    put(store, data, layers=1, tokens=1, bytes_per_token_layer=size)
    assert bytes(read(store, dest=bytearray(size), layers=1, tokens=1, bytes_per_token_layer=size)) == data
    path = store.path_for(DIGEST, 0xB10C)
    raw = bytearray(path.read_bytes())
    raw[PAYLOAD_OFFSET + offset] ^= 0x01
    path.write_bytes(raw)
    with pytest.raises(CorruptBlockError, match="checksum"):
        read(store, dest=bytearray(size), layers=1, tokens=1, bytes_per_token_layer=size)


@pytest.mark.parametrize(
    "expected",
    [
        {"layers": LAYERS - 1},
        {"tokens": TOKENS // 2},
        {"bytes_per_token_layer": BPT // 2},
        {"dtype": "float16"},
        {"kv_layout": 1},  # MLA's latent + rotary key where per-head K/V was written
    ],
)
def test_header_fields_that_differ_from_the_expected_are_corrupt(store: BlockStore, expected: dict[str, object]) -> None:
    put(store, payload())
    with pytest.raises(CorruptBlockError, match="header fields"):
        read(store, **expected)


def test_the_kv_layout_is_written_to_the_header_and_checked_on_read(store: BlockStore) -> None:
    from dualpath.kv import decode_header

    data = payload(3)
    put(store, data, kv_layout=1)
    assert decode_header(store.path_for(DIGEST, 0xB10C).read_bytes()).kv_layout == 1
    assert bytes(read(store, kv_layout=1)) == data
    with pytest.raises(CorruptBlockError, match="header fields"):
        read(store)  # read as per-head K/V


def test_a_file_at_another_blocks_path_is_corrupt_not_served(store: BlockStore) -> None:
    """A misplaced file (wrong model or wrong hash in its header) must not be served."""
    put(store, payload())
    for digest, block_hash in [(DIGEST + 1, 0xB10C), (DIGEST, 0xB10D)]:
        target = store.path_for(digest, block_hash)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(store.path_for(DIGEST, 0xB10C), target)
        with pytest.raises(CorruptBlockError, match="header fields"):
            read(store, block_hash=block_hash, digest=digest)


def test_no_temp_files_are_left_after_writes(store: BlockStore) -> None:
    for h in range(1, 6):
        put(store, payload(h), block_hash=h)
    put(store, payload(1), block_hash=1)
    names = [p.name for p in store.root.rglob("*") if p.is_file()]
    assert sorted(names) == sorted(f"{hash_hex(h)}.kvb" for h in range(1, 6))


def test_crash_before_rename_leaves_no_block_and_no_temp_file(store: BlockStore, monkeypatch: pytest.MonkeyPatch) -> None:
    def crash(src: object, dst: object) -> None:
        raise OSError("simulated crash before rename")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="simulated"):
        put(store, payload())
    assert not store.exists(DIGEST, 0xB10C)
    assert [p for p in store.root.rglob("*") if p.is_file()] == []


def test_a_leftover_temp_file_is_never_read_as_a_block(store: BlockStore) -> None:
    """A writer killed after writing its temp file but before the rename."""
    put(store, payload())
    final = store.path_for(DIGEST, 0xB10C)
    tmp = final.parent / f".{final.stem}.999.deadbeef.tmp"
    final.rename(tmp)
    assert not store.exists(DIGEST, 0xB10C)
    with pytest.raises(BlockMissingError):
        read(store)
    assert store.usage_bytes() == 0
    assert store.sweep_temp_files(older_than_s=3600) == 0  # too young: maybe a live writer
    os.utime(tmp, (0, 0))
    assert store.sweep_temp_files(older_than_s=3600) == 1
    assert not tmp.exists()


def test_delete_removes_the_block_and_is_idempotent(store: BlockStore) -> None:
    put(store, payload())
    store.delete(DIGEST, 0xB10C)
    store.delete(DIGEST, 0xB10C)
    with pytest.raises(BlockMissingError):
        read(store)
    assert store.usage_bytes() == 0


def test_bad_payload_and_destination_sizes_are_refused(store: BlockStore) -> None:
    with pytest.raises(ValueError, match="payload"):
        put(store, b"short")
    put(store, payload())
    with pytest.raises(ValueError, match="dest"):
        read(store, dest=bytearray(10))
    with pytest.raises(ValueError, match="read-only"):
        read(store, dest=memoryview(bytes(PAYLOAD_BYTES)))


@settings(max_examples=40, deadline=None)
@given(
    layers=st.integers(1, 5),
    tokens=st.integers(1, 70),
    bpt=st.integers(1, 40),
    seed=st.integers(0, 9),
)
def test_any_block_shape_round_trips(layers: int, tokens: int, bpt: int, seed: int) -> None:
    shape = dict(layers=layers, tokens=tokens, bytes_per_token_layer=bpt, dtype="uint8")
    data = payload(seed, layers * tokens * bpt)
    with tempfile.TemporaryDirectory() as tmp:
        store = BlockStore(tmp)
        put(store, data, block_hash=seed + 1, **shape)
        dest = bytearray(len(data) + 7)  # a larger buffer: only the payload prefix is written
        read(store, block_hash=seed + 1, dest=dest, **shape)
        assert bytes(dest[: len(data)]) == data
        assert dest[len(data) :] == bytearray(7)


def test_delete_removes_block_files_and_skips_missing_ones(tmp_path):
    store = BlockStore(tmp_path)
    for h in (1, 2, 3):
        store.write(model_digest=9, block_hash=h, layers=1, tokens=2, bytes_per_token_layer=4, dtype="uint8", payload=bytes(8))
    assert store.delete_many(9, [1, 3, 42]) == 2
    assert not store.path_for(9, 1).exists() and store.path_for(9, 2).exists() and not store.path_for(9, 3).exists()


def test_the_root_directories_and_block_files_are_the_owners_alone(store: BlockStore) -> None:
    """0700 directories, 0600 files: another local user can neither list nor read a prompt's KV."""
    put(store, payload(3))
    block = store.path_for(DIGEST, 0xB10C)
    assert block.stat().st_mode & 0o777 == 0o600
    for directory in (store.root, *(p for p in block.parents if store.root in p.parents)):
        assert directory.stat().st_mode & 0o777 == 0o700, directory
    assert hash_hex(0xB10C) in block.name and block.relative_to(store.root).parts[0] == hash_hex(DIGEST)  # hashes only


def test_an_existing_root_keeps_its_mode(tmp_path: Path) -> None:
    """A shared mount's root is its administrator's: the store does not chmod it."""
    root = tmp_path / "shared"
    root.mkdir()
    root.chmod(0o750)
    BlockStore(root)
    assert root.stat().st_mode & 0o777 == 0o750


def _write_v1(store: BlockStore, data: bytes, block_hash: int = 0xB10C) -> Path:
    """A block file of the first layout (the payload right after the 64-byte header), as
    stores wrote them before format version 2."""
    import xxhash

    from dualpath.kv import HEADER_BYTES, BlockHeader, encode_header

    header = BlockHeader(version=1, model_digest=DIGEST, block_hash=block_hash, checksum=xxhash.xxh3_64_intdigest(data),
                         layers=LAYERS, tokens=TOKENS, bytes_per_token_layer=BPT, dtype="bfloat16")  # fmt: skip
    path = store.path_for(DIGEST, block_hash)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(encode_header(header) + data)
    assert path.stat().st_size == HEADER_BYTES + len(data)
    return path


def test_a_version_1_file_is_still_read_and_verified(store: BlockStore) -> None:
    data = payload(7)
    path = _write_v1(store, data)
    assert bytes(read(store)) == data
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0x01
    path.write_bytes(raw)
    with pytest.raises(CorruptBlockError, match="checksum"):
        read(store)


def test_new_blocks_are_written_as_version_2_with_the_payload_at_4_kib(store: BlockStore) -> None:
    from dualpath.kv import HEADER_BYTES, decode_header

    data = payload(8)
    put(store, data)
    raw = store.path_for(DIGEST, 0xB10C).read_bytes()
    assert decode_header(raw).version == 2
    assert raw[HEADER_BYTES:PAYLOAD_OFFSET] == bytes(PAYLOAD_OFFSET - HEADER_BYTES)
    assert raw[PAYLOAD_OFFSET:] == data
    damaged = bytearray(raw)
    damaged[HEADER_BYTES + 100] = 1
    store.path_for(DIGEST, 0xB10C).write_bytes(damaged)
    with pytest.raises(CorruptBlockError, match="padding"):
        read(store)


def test_a_header_whose_version_disagrees_with_the_file_size_is_corrupt(store: BlockStore) -> None:
    """A version 1 header in front of a version 2 layout (or the other way round) is not read
    at the wrong offset."""
    from dualpath.kv import HEADER_BYTES

    data = payload(9)
    v1 = _write_v1(store, data).read_bytes()
    path = store.path_for(DIGEST, 0xB10C)
    path.write_bytes(v1[:HEADER_BYTES] + bytes(PAYLOAD_OFFSET - HEADER_BYTES) + data)  # v1 header, v2 layout
    with pytest.raises(CorruptBlockError, match="version 1 header"):
        read(store)
    put(store, data)
    v2 = path.read_bytes()
    path.write_bytes(v2[:HEADER_BYTES] + data)  # v2 header, v1 layout
    with pytest.raises(CorruptBlockError, match="version 2 header"):
        read(store)
