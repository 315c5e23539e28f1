"""Stored ``/v1/responses`` answers in a NATS JetStream key-value bucket: every gateway replica
reads what any of them stored, a gateway restart loses nothing, and JetStream drops an entry
``ttl`` seconds after it was written (the bucket's ``max_age``).

One entry per response, keyed by its id, holding the response object, the input items of its
own request and its ``previous_response_id``: a conversation is rebuilt by walking that chain,
so no entry grows with the conversation. The value is JSON.

Each entry records its tenant (the API key's, ``services.gateway.tenancy``): a lookup for any
other tenant finds nothing, as if the id had never been stored.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from nats.errors import Error as NatsError
from nats.errors import MaxPayloadError
from nats.js import JetStreamContext
from nats.js.errors import APIError, BucketNotFoundError, KeyNotFoundError, NotFoundError
from nats.js.kv import KeyValue

from dualpath.telemetry.logs import get_logger

__all__ = ["ResponseStore", "StoreError", "StoredResponse"]

log = get_logger("gateway.responses")
_KEY = re.compile(r"^[A-Za-z0-9_\-]{1,128}$")  # what our ids look like (and NATS keys accept)


class StoreError(Exception):
    """Raised when the bucket cannot be used (no JetStream on the server, a timeout) or refuses
    a write (the entry is larger than the server's max payload): ``reason`` says which."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"the stored-responses bucket is unavailable: {reason}")
        self.reason = reason


@dataclass(slots=True, kw_only=True)
class StoredResponse:
    response: dict[str, Any]  # the response object as returned
    input_items: list[dict[str, Any]]  # this request's own input items (with ids)
    previous_response_id: str | None
    session: str  # the conversation's agent session (the chain's first response id, or the client's)
    tenant: str = ""  # whose it is: only requests of this tenant find it ("" on an open gateway)

    def to_json(self) -> bytes:
        return json.dumps(
            {
                "response": self.response,
                "input_items": self.input_items,
                "previous": self.previous_response_id,
                "session": self.session,
                "tenant": self.tenant,
            },
            ensure_ascii=False,
            separators=(",", ":"),
        ).encode()

    @classmethod
    def from_json(cls, data: bytes) -> StoredResponse:
        obj = json.loads(data)
        return cls(
            response=obj["response"],
            input_items=obj["input_items"],
            previous_response_id=obj["previous"],
            session=obj["session"],
            tenant=obj.get("tenant", ""),  # entries stored before tenants: the open gateway's
        )


class ResponseStore:
    """The bucket ``bucket`` (created on first use, R3 on a cluster, R1 on a single server)."""

    def __init__(self, js: JetStreamContext, bucket: str, *, ttl_s: float) -> None:
        self.js, self.bucket, self.ttl_s = js, bucket, ttl_s
        self._kv: KeyValue | None = None

    async def _bucket(self) -> KeyValue:
        """The bucket, opened (or created) on first use.

        Raises:
            StoreError: JetStream did not answer or refused (e.g. the server runs without it).
        """
        if self._kv is not None:
            return self._kv
        try:
            self._kv = await self._open()
        except (NatsError, TimeoutError) as exc:
            raise StoreError(str(exc) or type(exc).__name__) from None
        return self._kv

    async def _open(self) -> KeyValue:
        try:
            kv = await self.js.key_value(self.bucket)
            info = await self.js.stream_info(f"KV_{self.bucket}")
            if info.config.max_age != self.ttl_s:  # the TTL is the deployment's: the latest gateway's setting wins
                info.config.max_age = self.ttl_s
                info.config.duplicate_window = min(info.config.duplicate_window or self.ttl_s, self.ttl_s)  # JetStream requires it
                await self.js.update_stream(info.config)
        except (BucketNotFoundError, NotFoundError):
            kv = None
            for replicas in (3, 1):
                try:
                    kv = await self.js.create_key_value(bucket=self.bucket, ttl=self.ttl_s, history=1, replicas=replicas)
                    break
                except APIError as exc:
                    if replicas == 1:
                        raise
                    log.info("responses_bucket_replicas", replicas=replicas, error=str(exc))
        assert kv is not None
        return kv

    async def put(self, rid: str, entry: StoredResponse) -> None:
        """Store ``entry`` under ``rid``.

        Raises:
            StoreError: too large for the server's max payload, or JetStream refused it.
        """
        try:
            await (await self._bucket()).put(rid, entry.to_json())
        except MaxPayloadError:
            raise StoreError("the response is larger than the NATS server's max payload; send it with store: false") from None
        except (NatsError, TimeoutError) as exc:
            raise StoreError(str(exc) or type(exc).__name__) from None

    async def get(self, rid: str, *, tenant: str = "") -> StoredResponse | None:
        """The entry stored under ``rid`` for ``tenant``; None when there is none (never stored,
        deleted, expired) or it is another tenant's.

        Raises:
            StoreError: the bucket is unavailable.
        """
        if not _KEY.match(rid):
            return None
        kv = await self._bucket()
        try:
            entry = await kv.get(rid)
        except KeyNotFoundError:  # KeyDeletedError included
            return None
        except (NatsError, TimeoutError) as exc:
            raise StoreError(str(exc) or type(exc).__name__) from None
        found = StoredResponse.from_json(entry.value) if entry.value else None
        return found if found is not None and found.tenant == tenant else None

    async def delete(self, rid: str, *, tenant: str = "") -> bool:
        """Delete ``rid``'s entry; False when ``tenant`` has none under that id.

        Raises:
            StoreError: the bucket is unavailable.
        """
        if await self.get(rid, tenant=tenant) is None:
            return False
        try:
            await (await self._bucket()).purge(rid)
        except (NatsError, TimeoutError) as exc:
            raise StoreError(str(exc) or type(exc).__name__) from None
        return True

    async def chain(self, rid: str, *, tenant: str = "", limit: int = 10_000) -> list[StoredResponse] | None:
        """The entries of the conversation ending at ``rid``, oldest first; None when ``rid`` or
        an earlier response of its chain is gone (or is not ``tenant``'s)."""
        out: list[StoredResponse] = []
        at: str | None = rid
        while at is not None and len(out) < limit:
            entry = await self.get(at, tenant=tenant)
            if entry is None:
                return None
            out.append(entry)
            at = entry.previous_response_id
        return out[::-1]
