"""The relay root's tree state, from its own state and the states its children's feeds hold."""

from __future__ import annotations

import dataclasses

from deltarl.config.refit import RelayTarget
from deltarl.refit.receiver_state import ReceiverState, StateFeed
from deltarl.refit.relay import Relay, _Item
from deltarl.transport.link_config import ShmLinkConfig

OWN = ReceiverState(session="root", active_version=5, needs_full=False)


def _relay(*labels: str, max_queued_bytes: int = 1 << 20) -> tuple[Relay, list[StateFeed]]:
    feeds = [StateFeed() for _ in labels]
    targets = [
        RelayTarget(
            f"ipc:///x/{label}.sock", ShmLinkConfig(), name=label, max_queued_bytes=max_queued_bytes
        )
        for label in labels
    ]
    relay = Relay(tuple(zip(targets, feeds, strict=True)), senders=lambda _: None)  # type: ignore[arg-type, return-value]
    return relay, feeds


def test_the_tree_holds_a_version_only_when_every_member_does() -> None:
    relay, (b, c) = _relay("b", "c")
    b.update(ReceiverState("sb", 5, False))
    c.update(ReceiverState("sc", 4, False))  # c has not activated 5 yet
    tree = relay.tree(OWN)
    assert tree.session == "root/b:sb/c:sc"
    assert tree.active_version is None
    c.update(ReceiverState("sc", 5, False))
    tree = relay.tree(OWN)
    assert (tree.active_version, tree.needs_full) == (5, False)
    assert tree.members["c"] == {**tree.members["c"], "reachable": True, "active_version": 5}


def test_a_silent_member_changes_the_session_and_is_left_out() -> None:
    relay, (b, c) = _relay("b", "c")
    b.update(ReceiverState("sb", 5, False))
    tree = relay.tree(OWN)  # c never heard from
    assert tree.session == "root/b:sb/c:?"
    assert tree.active_version == 5  # a dead member slows the tree by one full version only
    assert tree.members["c"]["reachable"] is False
    c.update(ReceiverState("sc", 5, False))
    assert relay.tree(OWN).session != tree.session  # its return is a change: a full version


def test_needs_full_and_the_newest_failure_rise_from_any_member() -> None:
    relay, (b,) = _relay("b")
    b.update(ReceiverState("sb", 5, True, failed_version=6, failed_reason="checksum"))
    tree = relay.tree(dataclasses.replace(OWN, failed_version=3, failed_reason="old"))
    assert tree.needs_full
    assert (tree.failed_version, tree.failed_reason) == (6, "checksum")
    status = relay.status(tree)
    assert status["last_failed"] == {"version": 6, "reason": "checksum"}


def test_a_child_too_far_behind_loses_the_version_which_counts_as_a_failure() -> None:
    relay, (b,) = _relay("b", max_queued_bytes=10)
    b.update(ReceiverState("sb", 5, False))
    child = relay.children[0]
    child.offer(_Item(6, 0, b"x" * 8))
    child.offer(_Item(6, 1, b"x" * 8))  # over the bound: version 6 is lost for b
    child.offer(_Item(6, 2, b"x"))  # and nothing more of it is queued
    assert child.queued_bytes == 8
    assert child.dropped_versions == 1
    tree = relay.tree(OWN)
    assert tree.failed_version == 6
    assert "not relayed to b" in tree.failed_reason
