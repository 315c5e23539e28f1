"""Leadership through a NATS JetStream key-value lease (one active scheduler, the others standby).

The lease is one key (``leader``) in a KV bucket whose entries expire ``ttl`` seconds after
their last write. The mechanism is JetStream's own, not a protocol of ours:

- *acquire*: ``create`` the key, which JetStream refuses while it exists (compare-and-set on
  "no previous value"); a standby retries every ``ttl / 4``;
- *renew*: ``update`` the key with the revision we wrote last (compare-and-set on the
  revision), every ``ttl / 3``; a write by anybody else makes ours fail;
- *expire*: a holder that stops renewing (killed, paused, cut off) loses the key ``ttl`` after
  its last renewal, when JetStream removes the entry; a standby's next ``create`` then wins.
- *release*: a clean shutdown deletes the key (compare-and-set on our revision) so a standby
  takes over at its next try instead of after ``ttl``.

A holder considers itself leader only while its last successful renewal is younger than
``ttl - margin`` (its own clock), so it stops acting before a standby can have taken over;
it learns it lost when a renewal fails and then must stop (the scheduler exits and its
supervisor starts it again as a standby). Takeover after a holder dies is bounded by
``ttl + ttl / 4`` plus the standby's start of work.
"""

from __future__ import annotations

import asyncio
import time

from nats.js import JetStreamContext
from nats.js.errors import APIError, BucketNotFoundError, KeyWrongLastSequenceError, NotFoundError
from nats.js.kv import KeyValue

from dualpath.telemetry.logs import get_logger

__all__ = ["LeaderLease", "LeaseLostError"]

log = get_logger("lease")
KEY = "leader"


class LeaseLostError(RuntimeError):
    """Raised by ``hold`` when another holder took the lease or renewals failed for too long."""


class LeaderLease:
    """One candidate's view of the lease in ``bucket``."""

    def __init__(self, js: JetStreamContext, bucket: str, holder: str, *, ttl: float = 3.0, margin: float = 0.5) -> None:
        if ttl <= 2 * margin:
            raise ValueError(f"lease ttl {ttl}s must exceed twice the margin {margin}s")
        self.js, self.bucket, self.holder = js, bucket, holder
        self.ttl, self.margin = ttl, margin
        self.revision = 0
        self.renewed_at = 0.0  # monotonic time of the last successful write
        self._kv: KeyValue | None = None

    async def _bucket(self, replicas: int = 3):
        if self._kv is not None:
            return self._kv
        try:
            self._kv = await self.js.key_value(self.bucket)
        except (BucketNotFoundError, NotFoundError):
            for r in sorted({replicas, 1}, reverse=True):  # R3 on a cluster, R1 on a single server
                try:
                    self._kv = await self.js.create_key_value(bucket=self.bucket, ttl=self.ttl, history=1, replicas=r)
                    break
                except APIError as exc:
                    if r == 1:
                        raise
                    log.info("lease_bucket_replicas", replicas=r, error=str(exc))
        return self._kv

    @property
    def valid(self) -> bool:
        """True while this holder may act as leader (a renewal succeeded recently enough)."""
        return self.revision > 0 and time.monotonic() - self.renewed_at < self.ttl - self.margin

    async def try_acquire(self) -> bool:
        """One attempt to take the lease. Raises nothing for "taken"; JetStream errors propagate."""
        kv = await self._bucket()
        t0 = time.monotonic()
        try:
            self.revision = await kv.create(KEY, self.holder.encode())
        except KeyWrongLastSequenceError:
            return False
        except APIError as exc:  # older servers word "exists" as a plain API error
            if "wrong last sequence" in str(exc):
                return False
            raise
        self.renewed_at = t0
        log.info("lease_acquired", holder=self.holder, bucket=self.bucket, revision=self.revision)
        return True

    async def acquire(self, stop: asyncio.Event) -> bool:
        """Wait until this candidate holds the lease (True) or ``stop`` is set (False)."""
        while not stop.is_set():
            try:
                if await self.try_acquire():
                    return True
            except Exception as exc:  # noqa: BLE001 - JetStream restarting or electing: try again
                log.warning("lease_acquire_failed", error=str(exc))
            try:
                await asyncio.wait_for(stop.wait(), self.ttl / 4)
            except TimeoutError:
                pass
        return False

    async def renew(self) -> None:
        """Write the lease again. Raises LeaseLostError if somebody else wrote it meanwhile."""
        kv = await self._bucket()
        t0 = time.monotonic()
        try:
            self.revision = await kv.update(KEY, self.holder.encode(), last=self.revision)
        except KeyWrongLastSequenceError:
            raise LeaseLostError(f"lease {self.bucket} taken by another holder") from None
        self.renewed_at = t0

    async def hold(self, stop: asyncio.Event) -> None:
        """Renew every ``ttl / 3`` until ``stop`` is set; then release.

        Raises:
            LeaseLostError: another holder took the lease, or no renewal succeeded for
                ``ttl - margin`` seconds (a standby may be leader by now).
        """
        try:
            while not stop.is_set():
                try:
                    await asyncio.wait_for(stop.wait(), self.ttl / 3)
                    break
                except TimeoutError:
                    pass
                try:
                    await self.renew()
                except LeaseLostError:
                    raise
                except Exception as exc:  # noqa: BLE001 - NATS down for a moment: retry until the lease is void
                    log.warning("lease_renew_failed", error=str(exc))
                if not self.valid:
                    raise LeaseLostError(f"lease {self.bucket} not renewed for {time.monotonic() - self.renewed_at:.1f}s")
        finally:
            if stop.is_set():
                await self.release()

    async def release(self) -> None:
        """Give the lease up (if still ours) so a standby takes over at once."""
        if not self.revision:
            return
        try:
            kv = await self._bucket()
            await kv.delete(KEY, last=self.revision)
            log.info("lease_released", holder=self.holder)
        except Exception as exc:  # noqa: BLE001 - expiry frees it anyway
            log.warning("lease_release_failed", error=str(exc))
        self.revision = 0


# ---- the scheduler's use of the lease (a small hook in services/scheduler/service.py) ----------


def add_lease_arguments(parser) -> None:
    """``--leader-lease``, ``--scheduler-id``, ``--lease-ttl``: active/standby schedulers."""
    from dualpath.config import parse_bool

    parser.add_argument(
        "--leader-lease",
        type=parse_bool,
        default=False,
        help="run as one of several schedulers: act only while holding the JetStream KV lease (default false)",
    )
    parser.add_argument("--scheduler-id", default="", help="this scheduler's name in the lease (default: host and pid)")
    parser.add_argument("--lease-ttl", type=float, default=3.0, help="seconds a dead leader keeps the lease (takeover bound)")


async def wait_for_leadership(js: JetStreamContext, bucket: str, ns, stop: asyncio.Event) -> LeaderLease | None:
    """Standby until this scheduler holds the lease (returns it), or None when leases are off
    or ``stop`` came first (then ``stop`` is set)."""
    if not ns.leader_lease:
        return None
    import os
    import socket

    holder = ns.scheduler_id or f"{socket.gethostname()}-{os.getpid()}"
    lease = LeaderLease(js, bucket, holder, ttl=ns.lease_ttl)
    log.info("scheduler_standby", holder=holder, bucket=bucket)
    if not await lease.acquire(stop):
        return None
    log.info("scheduler_active", holder=holder, revision=lease.revision)
    return lease


async def keep_leading(lease: LeaderLease | None, stop: asyncio.Event) -> None:
    """Renew ``lease`` until ``stop``; if it is lost, set ``stop`` so this scheduler stops acting
    (the process ends and its supervisor starts it again as a standby)."""
    if lease is None:
        return
    try:
        await lease.hold(stop)
    except LeaseLostError as exc:
        log.error("scheduler_lease_lost", holder=lease.holder, error=str(exc))
        stop.set()
