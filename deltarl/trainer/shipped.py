"""A ``Batch`` reply into trainable groups: its samples fetched by reference, checked, decoded.

The scheduler's ``Batch.groups[i]`` names each group's samples by digest (``samples_ref``) and
carries their ``rewards``; the bytes are on the scheduler's samples endpoint
(``deltarl.transport.blobs``). Here they are fetched in one get, each checked against its
digest (the bytes are the ones the scheduler validated, or they are refused), decoded into a
``deltarl.rl.samples.Group`` and paired with its rewards. The samples are not validated again:
``decode_group`` is that validation, and it ran on these very bytes at the scheduler.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from deltarl.rl.samples import SampleError, decode_group
from deltarl.trainer.grpo import BatchError, ScoredGroup
from deltarl.transport.blobs import BlobMissingError, blob_digest

FetchBlobs = Callable[[list[str], float], Awaitable[list[bytes]]]
"""The blobs of some digests from the scheduler's samples endpoint, in order, with a timeout
in seconds (BlobClient.get is one): TimeoutError or ConnectionError when it does not answer,
BlobMissingError when it does not hold one."""


@dataclass(frozen=True)
class ShippedItem:
    """What a ``Batch`` says of one group, its form checked."""

    group_id: str
    samples_ref: str
    rewards: tuple[float, ...]
    lag: int | None


def parse_items(items: Sequence[Any]) -> list[ShippedItem]:
    """The groups of a ``Batch`` reply; BatchError naming the group that is malformed."""
    parsed = []
    for i, item in enumerate(items):
        gid = item.get("group_id", i) if isinstance(item, dict) else i
        ref = item.get("samples_ref") if isinstance(item, dict) else None
        rewards = item.get("rewards") if isinstance(item, dict) else None
        if not isinstance(ref, str):
            raise BatchError(f"group {gid!r}: no samples_ref (a samples digest)")
        numbers = isinstance(rewards, list) and all(
            isinstance(r, int | float) and not isinstance(r, bool) for r in rewards
        )
        if not numbers:
            raise BatchError(f"group {gid!r}: rewards must be a list of numbers")
        lag = item.get("lag")
        parsed.append(
            ShippedItem(
                str(gid),
                ref,
                tuple(float(r) for r in rewards),
                lag if isinstance(lag, int) and not isinstance(lag, bool) else None,
            )
        )
    return parsed


async def fetch_groups(
    items: Sequence[ShippedItem],
    fetch: FetchBlobs,
    timeout: float,  # noqa: ASYNC109 - the request's own, sent with it
) -> list[ScoredGroup]:
    """The decoded groups of ``items``, in order.

    BatchError if a blob is missing, is not the bytes of its digest, does not decode, or
    holds another group; TimeoutError or ConnectionError if the samples endpoint is silent.
    """
    refs = [item.samples_ref for item in items]
    try:
        blobs = await fetch(refs, timeout)
    except BlobMissingError as e:
        raise BatchError(f"the scheduler's samples endpoint lost a group's samples: {e}") from None
    if len(blobs) != len(items):
        raise BatchError(f"asked for {len(items)} groups' samples, got {len(blobs)}")
    groups = []
    for item, blob in zip(items, blobs, strict=True):
        if blob_digest(blob) != item.samples_ref:
            raise BatchError(
                f"group {item.group_id!r}: its samples are not the bytes of {item.samples_ref}"
            )
        try:
            group = decode_group(blob)
        except SampleError as e:
            raise BatchError(f"group {item.group_id!r}: {e}") from None
        if group.group_id != item.group_id:
            raise BatchError(
                f"group {item.group_id!r}: its samples are those of group {group.group_id!r}"
            )
        groups.append(ScoredGroup(group, item.rewards))
    return groups
