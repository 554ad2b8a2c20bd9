"""A step seen committed stays committed, on an object-store root shared by several writers,
and the windows around a claim's lease and a step's manifest (the harness, servers and stalls
of tests/test_s3_fencing.py).

1. A writer that stalls past the stale time after its manifest write, before its second
   renewal, keeps its complete manifest on waking when another writer's start-up removed its
   lease as a gone writer's and was refused the step as committed; a claim never takes a stale
   lease over in a committed step (the stalled writer then commits); a manifest written while
   the clean-up removes its writer's objects is withdrawn, by the clean-up or by its writer,
   whichever looked last; and a kept manifest is replaced by the writer that holds the claim,
   whose commit removes the objects it named.
2. A lease that vanishes between a look and a removal is never the one removed: the start-up
   clean-up, and a claim taking a step over, remove only the lease they judged, so a claim
   made meanwhile by another writer keeps its lease.
3. A manifest that a writer stalled before its manifest write puts *after* the clean-up's
   second look, the writer then killed before its own check, is withdrawn by the next start:
   no step is listed whose files are gone.
4. A writer that replaces a kept manifest (written by a writer that had lost the claim) does
   it in one request: killed right after it, the step is committed. Stalled before it while a
   clean-up removes its objects, it puts the replaced manifest back when its own is withdrawn:
   a step seen committed stays committed.
"""

from __future__ import annotations

import signal
from typing import Any

import pytest

s3fs = pytest.importorskip("s3fs")
from test_s3_fencing import (  # noqa: E402
    STALE_S,
    WAIT_S,
    _kept_then_claimed,
    _until_stale,
    bucket,  # noqa: F401  (fixture)
    config,
    needs_pidns,
    only_the_committed_objects_are_left,
    raw,
    restored_writer,
    server,  # noqa: F401  (fixture)
    step_keys,
    writers,  # noqa: F401  (fixture)
)

from ckptmgr import CheckpointManager, StagingOptions, StepExistsError, StepNotFoundError  # noqa: E402

STEP = "step_000000000005"


def _lease_token(server, bucket: str, key: str) -> str | None:  # noqa: F811
    from ckptmgr.storage.lease import Lease

    lease = Lease.from_bytes(raw(server).cat_file(f"{bucket}/{key}"))
    return None if lease is None else lease.token


# ------------------------------------------------------------ a step seen committed stays committed


@needs_pidns
def test_a_step_another_writer_was_refused_as_committed_stays_committed(server, bucket, writers):  # noqa: F811
    """The other writer's start-up removes the stalled writer's lease as a gone writer's and
    lists the step as committed: the stalled writer, woken, finds its claim gone, and keeps its
    manifest (every file it names is there), though its save is not durable."""
    root = f"s3://{bucket}/run"
    stale = writers(config(server, root, 1, stop="after-manifest"), ns=True)
    stale.expect("stopped")  # its manifest is written under its claim; it stalls before its second renewal
    _until_stale(server, bucket, "run/step_000000000005/writer.lease")
    [refused] = writers(config(server, root, 2)).finish()  # its start-up lists step 5 as committed
    assert not refused["durable"] and "already committed" in refused["error"], refused
    assert "writer.lease" not in step_keys(server, bucket, "run/step_000000000005/")  # removed as a gone writer's
    stale.signal(signal.SIGCONT)
    [late] = stale.finish()
    assert restored_writer(server, root, 5) == 1  # the step the other writer was refused for is still there
    assert not late["durable"] and "taken over" in late["error"] and "manifest was kept" in late["error"], late
    only_the_committed_objects_are_left(server, bucket, "run/step_000000000005/")


@needs_pidns
def test_a_claim_never_takes_a_stale_lease_over_in_a_committed_step(server, bucket, writers):  # noqa: F811
    """The other writer, started before the step was committed, claims it while the stalled
    writer's lease is stale and its manifest written: refused as committed, the lease left as it
    was; the stalled writer, woken, renews its claim and commits."""
    root = f"s3://{bucket}/run"
    other = writers(config(server, root, 2, gate="save"))
    other.expect("gate")  # started (its start-up clean-up done) on a root with no step
    stale = writers(config(server, root, 1, stop="after-manifest"), ns=True)
    stale.expect("stopped")
    key = "run/step_000000000005/writer.lease"
    _until_stale(server, bucket, key)
    lease = raw(server).cat_file(f"{bucket}/{key}")
    other.go()  # its save of step 5 finds a stale lease beside a manifest
    [refused] = other.finish()
    assert not refused["durable"] and "already committed" in refused["error"], refused
    assert raw(server).cat_file(f"{bucket}/{key}") == lease  # not taken over, not renewed by anyone
    stale.signal(signal.SIGCONT)
    [late] = stale.finish()
    assert late["durable"] and late["error"] is None, late  # its claim was held throughout
    assert restored_writer(server, root, 5) == 1
    only_the_committed_objects_are_left(server, bucket, "run/step_000000000005/")


@pytest.mark.one_server_in_ci
@needs_pidns
@pytest.mark.parametrize("wake", ["before-delete", "after-delete"])
def test_a_manifest_written_while_its_objects_are_swept_is_withdrawn(server, bucket, writers, wake):  # noqa: F811
    """The clean-up judges a writer stalled before its manifest write gone, finds no manifest,
    and is held there (before-delete) or once it deleted the writer's objects (after-delete)
    while the writer wakes, writes its manifest, finds its claim gone and ends. Before the
    delete, the writer sees every file in place and keeps its manifest: the clean-up, looking
    again after its delete, withdraws it. After the delete, the writer withdraws it itself.
    Either way the step is not listed: no manifest names objects that are gone."""
    from ckptmgr.storage import open_target
    from ckptmgr.storage.commit.object_leftovers import remove_object_leftovers

    root = f"s3://{bucket}/run"
    prefix = "run/step_000000000005/"
    stale = writers(config(server, root, 1, stop="manifest"), ns=True)
    stale.expect("stopped")  # its files are written and checked; its manifest is not
    _until_stale(server, bucket, prefix + "writer.lease")
    target = open_target(root, server.options())
    held: list[list[dict[str, Any]]] = []

    def woken_and_ended() -> None:
        stale.signal(signal.SIGCONT)
        held.append(stale.finish())

    real_exists, real_remove = target.exists, target.remove

    def exists(rel: str) -> bool:  # the clean-up's look for a manifest in a step it found without one
        there = real_exists(rel)
        if wake == "before-delete" and rel == "step_000000000005/manifest.json" and not held:
            assert not there
            woken_and_ended()
            assert "manifest.json" in step_keys(server, bucket, prefix)  # written past the look
        return there

    def remove(rels: list[str]) -> None:
        real_remove(rels)
        if wake == "after-delete" and any("/data-" in r for r in rels) and not held:
            woken_and_ended()

    target.exists, target.remove = exists, remove
    try:
        removed = remove_object_leftovers(target, STALE_S)
    finally:
        target.exists, target.remove = real_exists, real_remove
        target.close()
    assert step_keys(server, bucket, prefix) == []
    with pytest.raises(StepNotFoundError):
        restored_writer(server, root, 5)
    [[late]] = held
    assert not late["durable"], late
    if wake == "before-delete":
        assert "manifest was kept" in late["error"], late  # every file was there when it looked
        assert f"{root}/step_000000000005/manifest.json" in removed, removed
    else:
        assert "manifest was withdrawn" in late["error"] and "is gone" in late["error"], late



@needs_pidns
def test_a_kept_manifest_is_replaced_by_the_writer_that_holds_the_claim(server, bucket, writers):  # noqa: F811
    live, late, root = _kept_then_claimed(server, bucket, writers)
    assert not late["durable"] and "taken over" in late["error"] and "manifest was kept" in late["error"], late
    assert restored_writer(server, root, 5) == 1  # complete, so kept: another process may have seen it
    live.go()
    [committed] = live.finish()
    assert committed["durable"] and committed["error"] is None, committed
    assert restored_writer(server, root, 5) == 2
    only_the_committed_objects_are_left(server, bucket, "run/step_000000000005/")  # its commit swept the step


# ------------------------------------------------------------ a lease that vanished is not removed


def test_the_clean_up_never_removes_a_claim_made_after_it_looked(server, bucket):  # noqa: F811
    """The clean-up lists a step's lease; its writer releases it before the clean-up reads it,
    and another writer claims the step before the clean-up goes on: that claim's lease stays."""
    from ckptmgr.storage import open_target
    from ckptmgr.storage.commit.object_leftovers import remove_object_leftovers
    from ckptmgr.storage.lease import current, release

    root = f"s3://{bucket}/run"
    key = f"{STEP}/writer.lease"
    sweeper, other = open_target(root, server.options()), open_target(root, server.options())
    done = current()
    release(done)
    sweeper.put(key, done.to_bytes())  # listed by the clean-up
    claims: list[Any] = []
    real_get = sweeper.get

    def get(rel: str) -> bytes:
        if rel != key or claims:
            return real_get(rel)
        raw(server).rm(f"{bucket}/run/{key}")  # its writer released its claim (it finished)
        try:
            return real_get(rel)
        finally:
            claims.append(other.begin(5))  # a new claim on the step, before the clean-up goes on

    sweeper.get = get  # type: ignore[method-assign]
    try:
        remove_object_leftovers(sweeper, STALE_S)
        [w] = claims
        assert "writer.lease" in step_keys(server, bucket, f"run/{STEP}/")  # the new claim's lease stays
        assert _lease_token(server, bucket, f"run/{key}") == w.strategy.tag
        w.close()
    finally:
        sweeper.close()
        other.close()


def test_a_claim_never_removes_a_lease_created_after_it_looked(server, bucket):  # noqa: F811
    """A claim finds the step's lease, which its writer releases before the claim reads it, and
    another writer claims the step meanwhile: the claim is refused, the other claim's lease stays."""
    from ckptmgr.storage import open_target

    root = f"s3://{bucket}/run"
    key = f"{STEP}/writer.lease"
    first, second, third = (open_target(root, server.options()) for _ in range(3))
    holder = first.begin(5)
    claims: list[Any] = []
    real_get = second.get

    def get(rel: str) -> bytes:
        if rel != key or claims:
            return real_get(rel)
        holder.close()  # the first writer releases its claim (its save failed)
        try:
            return real_get(rel)
        finally:
            claims.append(third.begin(5))  # and another writer claims the step at once

    second.get = get  # type: ignore[method-assign]
    try:
        with pytest.raises(StepExistsError, match="claimed the step just now"):
            second.begin(5)
        [w] = claims
        assert "writer.lease" in step_keys(server, bucket, f"run/{STEP}/")
        assert _lease_token(server, bucket, f"run/{key}") == w.strategy.tag
        w.close()
    finally:
        for t in (first, second, third):
            t.close()


# ------------------------------------------------- a manifest put after the clean-up's second look


@pytest.mark.one_server_in_ci
@needs_pidns
def test_a_manifest_put_after_the_clean_up_and_left_by_a_killed_writer_is_withdrawn(server, bucket,  # noqa: F811
                                                                                       writers):  # noqa: F811
    """A writer stalls before its manifest write past the stale time; a start-up clean-up
    removes its lease and objects and looks again (no manifest yet); the writer wakes, writes
    its manifest and is killed before its own check. The next start withdraws that manifest:
    the step is never listed with its files gone."""
    from ckptmgr.storage import open_target
    from ckptmgr.storage.commit.object_leftovers import remove_object_leftovers

    root = f"s3://{bucket}/run"
    prefix = f"run/{STEP}/"
    stale = writers(config(server, root, 1, stop=["manifest", "after-manifest"]), ns=True)
    stale.expect("stopped")  # its files are written and checked, its claim renewed; its manifest is not
    _until_stale(server, bucket, prefix + "writer.lease")
    target = open_target(root, server.options())
    try:
        remove_object_leftovers(target, STALE_S)  # the whole sweep, its second look included
    finally:
        target.close()
    assert step_keys(server, bucket, prefix) == []
    stale.signal(signal.SIGCONT)
    stale.expect("stopped")  # its manifest is written (nothing was there), before its renewal
    stale.signal(signal.SIGKILL)
    stale.proc.wait(WAIT_S)
    assert step_keys(server, bucket, prefix) == ["manifest.json"]  # naming objects that are gone
    with CheckpointManager(root, storage_options=server.options(), staging=StagingOptions(local_tier=False)) as mgr:
        assert mgr.steps() == []  # the next start withdrew it
    assert step_keys(server, bucket, prefix) == []


# ----------------------------------------------- a replacing writer stalled before its delete


def _kept_then_taken_over(server, root: str, writers, stop: str):  # noqa: F811
    """Writer 2 (started first, on an empty root) takes over the claim of writer 1, which stalled
    before its manifest write; writer 1 wakes, writes its manifest, finds its claim gone and
    keeps the manifest (its files are all there). Returns writer 2, held at its commit gate, to
    stop at ``stop`` once let go."""
    live = writers(config(server, root, 2, takeover=True, gate=["save", "commit"], stop=stop), ns=True)
    live.expect("gate")  # started on an empty root
    stale = writers(config(server, root, 1, stop="manifest"), ns=True)
    stale.expect("stopped")
    live.go()
    live.expect("gate")  # it took the stale claim over, its files written
    stale.signal(signal.SIGCONT)
    [late] = stale.finish()
    assert not late["durable"] and "manifest was kept" in late["error"], late
    return live


@pytest.mark.one_server_in_ci
@needs_pidns
def test_a_replaced_manifest_is_put_back_when_the_replacing_one_is_withdrawn(server, bucket, writers):  # noqa: F811
    """Writer 1 keeps its complete manifest after its claim was taken over by writer 2 (the
    step restores, so it may have been seen committed). Writer 2 commits, stalls before the
    request that replaces that manifest, past the stale time; a start-up clean-up removes its
    lease and its objects (the manifest in place does not name them). Writer 2 wakes, replaces
    the manifest, finds its claim gone and withdraws its own (its objects are gone): it puts
    writer 1's manifest back, whose files are all there, so the step still restores."""
    from ckptmgr.storage import open_target
    from ckptmgr.storage.commit.object_leftovers import remove_object_leftovers

    root = f"s3://{bucket}/run"
    prefix = f"run/{STEP}/"
    live = _kept_then_taken_over(server, root, writers, stop="replace")
    assert restored_writer(server, root, 5) == 1  # seen committed
    live.go()
    live.expect("stopped")  # checked, renewed, found writer 1's manifest: before replacing it
    _until_stale(server, bucket, prefix + "writer.lease")
    target = open_target(root, server.options())
    try:
        remove_object_leftovers(target, STALE_S)
    finally:
        target.close()
    live.signal(signal.SIGCONT)
    [failed] = live.finish()
    assert not failed["durable"] and "taken over" in failed["error"], failed
    assert "put back" in failed["error"], failed
    assert restored_writer(server, root, 5) == 1  # still committed, with writer 1's files
    only_the_committed_objects_are_left(server, bucket, prefix)


@pytest.mark.one_server_in_ci
@needs_pidns
def test_a_writer_killed_as_it_replaces_a_kept_manifest_leaves_the_step_committed(server, bucket,  # noqa: F811
                                                                                    writers):  # noqa: F811
    """Writer 2, holding the claim, replaces writer 1's kept manifest at its commit and is killed
    right after the request that replaces it: the step is committed, with one manifest or the
    other (never none, which would leave writer 1's files to the next clean-up)."""
    root = f"s3://{bucket}/run"
    live = _kept_then_taken_over(server, root, writers, stop="after-replace")
    live.go()
    live.expect("stopped")  # its request that replaces writer 1's manifest is done
    live.signal(signal.SIGKILL)
    live.proc.wait(WAIT_S)
    with CheckpointManager(root, storage_options=server.options(), staging=StagingOptions(local_tier=False),
                           read_only=True) as mgr:
        assert mgr.steps() == [5]
    assert restored_writer(server, root, 5) == 2  # its manifest, written in the one request
