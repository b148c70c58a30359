"""The memory tier's pure rules (machine/memorytier.py): placement on a ring of the ready agents' nodes,
what the Checkpoint says of its tiers, which copies a restore may read, and which are known gone."""

from __future__ import annotations

from ibckpt.agentapi import MemoryCopyReport
from ibckpt.agentapi.memory import HeldCopies, HeldCopy
from ibckpt.api import MemoryCopy, StorageTier
from ibckpt_operator.machine import memorytier


def test_each_node_keeps_its_part_on_the_next_ready_node_never_itself() -> None:
    ring = ["n1", "n2", "n3", "n4"]
    assert memorytier.buddies(["n1", "n2"], ring) == {"n1": "n2", "n2": "n3"}
    assert memorytier.buddies(["n4"], ring) == {"n4": "n1"}  # the ring wraps
    assert memorytier.buddies(["n2", "n1"], ["n2", "n1"]) == {"n1": "n2", "n2": "n1"}
    # every holder keeps one other node's part: no node is chosen twice when the whole ring checkpoints
    chosen = memorytier.buddies(ring, ring)
    assert sorted(chosen.values()) == ring and all(node != buddy for node, buddy in chosen.items())


def test_a_lone_node_or_a_node_outside_the_ring_is_placed_by_name() -> None:
    assert memorytier.buddies(["n1"], ["n1"]) == {}  # nobody else: S3 only
    assert memorytier.buddies(["n1"], []) == {}
    # n2's agent is not ready: its part still goes to the next ready node after it
    assert memorytier.buddies(["n2"], ["n1", "n3"]) == {"n2": "n3"}
    assert memorytier.buddies(["n9"], ["n1", "n3"]) == {"n9": "n1"}


def test_the_checkpoint_lists_kept_copies_and_says_memory_only_when_every_part_has_one() -> None:
    reports = {
        "n1": MemoryCopyReport(node="n2", part="n1", kept=True, chunks=3, bytes=30),
        "n2": MemoryCopyReport(node="n3", part="n2", kept=False, message="over the budget"),
    }
    copies = memorytier.kept_copies(reports)
    assert copies == [MemoryCopy(part="n1", node="n2", chunks=3, bytes=30)]
    assert memorytier.tiers(copies, ["n1", "n2"]) == [StorageTier.S3]
    assert memorytier.tiers(copies, ["n1"]) == [StorageTier.S3, StorageTier.MEMORY]
    assert memorytier.tiers([], []) == [StorageTier.S3]


def test_a_restore_reads_only_copies_whose_holder_lives() -> None:
    copies = [MemoryCopy(part="n1", node="n2"), MemoryCopy(part="n2", node="n3")]
    assert memorytier.readable_copies(copies, {"n1", "n2"}) == [copies[0]]
    assert memorytier.readable_copies(copies, set()) == []


def _listing(node: str, *held: tuple[str, str, str, bool]) -> HeldCopies:
    copies = [
        HeldCopy(job=j, checkpoint=c, part=p, bytes=1, chunks=1, sealed=s, created_at=0)
        for j, c, p, s in held
    ]
    return HeldCopies(node=node, budget=10, used=len(copies), copies=copies)


def test_a_copy_is_read_only_where_its_holder_lists_it_and_forgotten_only_where_it_answered() -> None:
    copies = [
        MemoryCopy(part="n1", node="n2"),
        MemoryCopy(part="n2", node="n3"),
        MemoryCopy(part="n3", node="n1"),
    ]
    listings = {
        "n2": _listing("n2", ("ns/j", "c1", "n1", True), ("ns/j", "c0", "n3", True)),
        "n3": _listing(
            "n3", ("ns/j", "c1", "n2", False), ("ns/other", "c1", "n2", True)
        ),  # unsealed; another job
        "n1": None,  # did not answer: may still hold it
    }
    held, gone = memorytier.held_now(copies, listings, "ns/j", "c1")
    assert held == [copies[0]]
    assert gone == [copies[1]]


def test_a_newer_copy_of_the_same_part_on_the_same_holder_replaces_the_older() -> None:
    older = [MemoryCopy(part="n1", node="n2"), MemoryCopy(part="n2", node="n3")]
    newer = [MemoryCopy(part="n1", node="n2"), MemoryCopy(part="n2", node="n1")]  # n2's part moved holder
    assert memorytier.replaced(older, newer) == [older[1]]


def test_after_a_commit_on_s3_a_copy_counts_once_its_own_holder_lists_it_sealed() -> None:
    holders = {"n1": "n2", "n2": "n3", "n3": "n1"}  # each part and the node told to keep it
    listings = {
        "n2": _listing("n2", ("ns/j", "c1", "n1", True), ("ns/j", "c1", "n3", True)),  # n3's, not its own
        "n3": _listing("n3", ("ns/j", "c1", "n2", False)),  # still arriving
        "n1": None,  # did not answer
    }
    found = memorytier.sealed_copies(holders, listings, "ns/j", "c1")
    assert [(c.part, c.node) for c in found] == [("n1", "n2")]
    listings["n3"] = _listing("n3", ("ns/j", "c1", "n2", True), ("ns/j", "c0", "n2", True))
    listings["n1"] = _listing("n1", ("ns/other", "c1", "n3", True))  # another job's
    found = memorytier.sealed_copies(holders, listings, "ns/j", "c1")
    assert [(c.part, c.node) for c in found] == [("n1", "n2"), ("n2", "n3")]
