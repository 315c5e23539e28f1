"""The tcp transport over mutual TLS (``--data-tls``): every byte lands as without TLS, against
a peer process; a client or server without a certificate of the deployment's CA (or naming
another host) moves nothing; the flags and the factory."""

from __future__ import annotations

import argparse
import os
import socket
import stat
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import numpy as np
import pytest

from dualpath.config import NodeConfig, add_arguments, from_args
from dualpath.transfer import MemoryRegion, PeerLostError, TransferEntry, TransportUnavailableError, create_transport
from dualpath.transfer import tcp as tcp_module
from dualpath.transfer.peer import PeerProcess, pattern, spawn_peer
from dualpath.transfer.tcp_wire import REPLY, Op, encode_request
from dualpath.transfer.tls import TlsConfig, TlsStream, tls_accept, tls_connect
from dualpath.transfer.tls_certs import make_pki

pytestmark = pytest.mark.anyio

MIB = 1 << 20
SIZE = 16 * MIB


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, TlsConfig]:
    """The deployment's CA with certificates for 127.0.0.1 and for "localhost"."""
    return make_pki(tmp_path_factory.mktemp("pki"), ["127.0.0.1", "localhost"])


@pytest.fixture(scope="module")
def rogue(tmp_path_factory) -> TlsConfig:
    """A certificate for 127.0.0.1 from a CA nobody trusts."""
    return make_pki(tmp_path_factory.mktemp("rogue-pki"), ["127.0.0.1"], ca_name="rogue CA")["127.0.0.1"]


def _rid(tag: str) -> str:
    return f"test-tls-{tag}-{uuid.uuid4().hex[:12]}"


@pytest.fixture
async def served(pki) -> AsyncIterator[tuple[PeerProcess, str, MemoryRegion]]:
    """A peer process serving one region over TLS, and a local region to move bytes with."""
    rid = _rid("r")
    peer = spawn_peer("tcp", {rid: SIZE}, seed=3, tls=pki["127.0.0.1"])
    local = MemoryRegion(_rid("l"), SIZE)
    try:
        yield peer, rid, local
    finally:
        peer.stop()
        local.close()
        local.unlink()


async def test_reads_writes_and_strided_entries_over_tls_land_byte_for_byte(pki, served) -> None:
    peer, rid, local = served
    client = create_transport("tcp", node_id="c", data_tls=pki["127.0.0.1"], timeout_s=20.0)
    await client.start()
    try:
        await client.connect(peer.descriptors[rid])
        assert await client.read(local, [TransferEntry(0, rid, 0, SIZE)]) == SIZE  # 64 records a MiB, many chunks
        assert np.array_equal(local.as_array(), pattern(SIZE, 3))
        assert client._peers[("127.0.0.1", peer.descriptors[rid].address["port"])].sock.version() == "TLSv1.3"
        rng = np.random.default_rng(5)
        local.as_array()[:] = rng.integers(0, 256, SIZE, dtype=np.uint8)
        want = local.as_array().copy()
        # 300 scattered 4 KiB blocks (sealed together), a strided entry, one 4 MiB block
        blocks = [TransferEntry(i * 4096, rid, ((i * 7919) % 300) * 4096, 4096) for i in range(300)]
        strided = TransferEntry(2 * MIB, rid, 2 * MIB, 1000, count=64, local_stride=3000, remote_stride=5000)
        big = TransferEntry(8 * MIB, rid, 8 * MIB, 4 * MIB)
        await client.write(local, [*blocks, strided, big])
        local.as_array()[:] = 0
        async with anyio.create_task_group() as tg:  # pipelined on one connection
            for part in (blocks[:100], blocks[100:], [strided], [big]):
                tg.start_soon(client.read, local, part)
        got = local.as_array()
        for e in [*blocks, big]:
            assert np.array_equal(got[e.local_offset : e.local_offset + e.length], want[e.local_offset : e.local_offset + e.length])
        for lo, _ro, n in strided.pieces():
            assert np.array_equal(got[lo : lo + n], want[lo : lo + n])
    finally:
        await client.close()


async def test_a_client_whose_certificate_is_not_the_cas_reads_nothing(rogue, served) -> None:
    peer, rid, local = served
    for name, cfg in (("rogue CA", rogue), ("no TLS", None)):
        client = create_transport("tcp", node_id="rogue", data_tls=cfg, timeout_s=5.0, connect_timeout_s=5.0)
        await client.start()
        local.as_array()[:] = 0
        try:
            await client.connect(peer.descriptors[rid])
            with pytest.raises(PeerLostError):
                await client.read(local, [TransferEntry(0, rid, 0, MIB)])
        finally:
            await client.close()
        assert not local.as_array().any(), name


async def test_a_server_whose_certificate_is_from_another_ca_or_for_another_host_is_not_trusted(pki, rogue) -> None:
    local = MemoryRegion(_rid("l"), MIB)
    try:
        # "localhost"'s certificate served on 127.0.0.1: the client dialed an address it does not name
        for server_cfg, why in ((rogue, "certificate verify failed"), (pki["localhost"], "IP address mismatch")):
            rid = _rid("r")
            with spawn_peer("tcp", {rid: MIB}, tls=server_cfg) as peer:
                client = create_transport("tcp", node_id="c", data_tls=pki["127.0.0.1"], timeout_s=5.0)
                await client.start()
                try:
                    await client.connect(peer.descriptors[rid])
                    with pytest.raises(PeerLostError, match="TLS handshake failed") as info:
                        await client.write(local, [TransferEntry(0, rid, 0, MIB)])
                    assert why in str(info.value)
                finally:
                    await client.close()
    finally:
        local.close()
        local.unlink()


async def test_a_plaintext_frame_with_the_right_key_gets_no_byte_from_a_tls_server(pki, served) -> None:
    peer, rid, _local = served
    desc = peer.descriptors[rid]
    frame = encode_request(Op.READ, 0, 1, [TransferEntry(0, rid, 0, MIB)], 0, {rid: desc.key})
    with socket.create_connection(("127.0.0.1", desc.address["port"]), timeout=10) as sock:
        sock.sendall(frame)
        got = b""
        while chunk := sock.recv(1 << 16):
            got += chunk  # whatever comes before the server hangs up: a TLS alert at most
    assert len(got) < REPLY.size + 64 and bytes(pattern(64, 3)) not in got


async def test_the_tls_stream_answers_would_block_like_a_socket_and_keeps_a_chunk_the_socket_did_not_take(pki) -> None:
    """Sends until the socket is full, then reads everything on the other end: the bytes come
    through once each, in order, though sends stopped mid-chunk."""
    cfg = pki["127.0.0.1"]
    listener = socket.create_server(("127.0.0.1", 0))
    a = socket.create_connection(listener.getsockname())
    b, _ = listener.accept()
    listener.close()
    for s in (a, b):
        s.setblocking(False)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 << 10)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
    server: list[TlsStream] = []

    async def accept() -> None:
        server.append(await tls_accept(b, cfg))

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(accept)
            client = await tls_connect(a, cfg, "127.0.0.1")
        data = np.random.default_rng(1).integers(0, 256, 8 * MIB, dtype=np.uint8).tobytes()
        view = memoryview(data)
        bufs = [view[i : min(i + 3000, MIB)] for i in range(0, MIB, 3000)] + [view[MIB:]]  # small ones, then one large
        sent, received = 0, bytearray()
        sink = memoryview(bytearray(1 << 20))
        with pytest.raises(BlockingIOError):
            server[0].recv_into(sink)
        while sent < len(data):
            try:
                sent += client.sendmsg(_after(bufs, sent))
            except BlockingIOError:
                pass
            while True:
                try:
                    got, *_ = server[0].recvmsg_into([sink[:70000], sink[70000:]])
                except BlockingIOError:
                    break
                received += sink[:got]
        while len(received) < len(data):
            try:
                got = server[0].recv_into(sink)
            except BlockingIOError:
                await anyio.sleep(0.001)
                continue
            received += sink[:got]
        assert bytes(received) == data
        client.close()
        assert _read_to_end(server[0]) == 0  # the end of the stream reads as 0 bytes
    finally:
        a.close()
        b.close()


def _after(bufs: list[memoryview], skip: int) -> list[memoryview]:
    out = []
    for buf in bufs:
        if skip >= buf.nbytes:
            skip -= buf.nbytes
            continue
        out.append(buf[skip:])
        skip = 0
    return out


def _read_to_end(stream: TlsStream) -> int:
    sink = bytearray(1 << 16)
    while True:
        try:
            return stream.recv_into(sink)
        except BlockingIOError:
            continue


def test_the_factory_keeps_tls_to_tcp_and_a_missing_file_fails_at_start(pki, tmp_path) -> None:
    for name in ("shm", "verbs"):
        with pytest.raises(TransportUnavailableError, match="tcp transport only"):
            create_transport(name, node_id="n", data_tls=pki["127.0.0.1"])
    missing = TlsConfig(ca=str(tmp_path / "nope.pem"), cert=pki["127.0.0.1"].cert, key=pki["127.0.0.1"].key)
    transport = create_transport("tcp", node_id="n", data_tls=missing)
    assert isinstance(transport, tcp_module.TcpTransport)
    with pytest.raises(FileNotFoundError, match="nope.pem"):
        anyio.run(transport.start)


def test_the_data_tls_flags_name_the_three_files_and_refuse_to_run_without_them(pki) -> None:
    cfg = pki["127.0.0.1"]
    parser = argparse.ArgumentParser()
    add_arguments(parser, NodeConfig)
    ns = parser.parse_args(["--data-tls", "true", "--data-tls-ca", cfg.ca, "--data-tls-cert", cfg.cert, "--data-tls-key", cfg.key])
    assert from_args(NodeConfig, ns).data_tls_config() == cfg
    assert from_args(NodeConfig, parser.parse_args([])).data_tls_config() is None
    no_key = parser.parse_args(["--data-tls", "true", "--data-tls-ca", cfg.ca, "--data-tls-cert", cfg.cert])
    with pytest.raises(ValueError, match="--data-tls-key"):
        from_args(NodeConfig, no_key).data_tls_config()


def test_throwaway_private_keys_are_readable_by_their_owner_only(pki) -> None:
    for cfg in pki.values():
        assert stat.S_IMODE(os.stat(cfg.key).st_mode) == 0o600
        assert Path(cfg.cert).read_bytes().startswith(b"-----BEGIN CERTIFICATE-----")
        assert Path(cfg.ca).exists()
