"""A restore that reaches a local-tier slot while the restarted manager's adoption still pins it
does not wait for the whole adoption: it copies each piece as soon as the adoption has pinned
it. CUDA's registration is faked and held at a gate before a chosen piece (real threads and
events); the real registrations and copies run on a GPU in test_cuda.py."""

from __future__ import annotations

import itertools
import os
import threading
from dataclasses import dataclass, field

import pytest
import torch
from conftest import damage_last_chunk, hold_durable_write
from test_restore_atomic import _state, _target, _untouched
from test_tier_fast_open import _adoption_ended

import ckptmgr._cuda as cuda_shim
import ckptmgr.restore.restorer as restorer_mod
import ckptmgr.save.buffers as buffers_mod
import ckptmgr.storage.tier_pinning as pinning_mod
from ckptmgr import (
    CheckpointCorruptError,
    CheckpointManager,
    CkptError,
    ConfigError,
    Schedule,
    StagingOptions,
    WriteOptions,
)
from ckptmgr.storage.tier import tier_dir

CHUNK = 4096
PIECE = 4 * CHUNK  # pinned in pieces of four checksum chunks: the state's one file is eight pieces
HELD = 2  # the adoption is held before it registers piece 2: pieces 0 and 1 are pinned


@dataclass
class Gate:
    """CUDA's registration faked; the adoption thread's registration of piece ``HELD`` (the
    ``HELD + 1``-th) waits for ``go`` once ``armed``."""

    armed: bool = False
    entered: threading.Event = field(default_factory=threading.Event)
    go: threading.Event = field(default_factory=threading.Event)
    mu: threading.Lock = field(default_factory=threading.Lock)
    registered: set[int] = field(default_factory=set)
    adoption_pieces: int = 0
    checks: list[str] = field(default_factory=list)  # "at adoption" / "at restore"
    blocked: threading.Event = field(default_factory=threading.Event)  # a restore waits for a piece


@pytest.fixture
def gate(monkeypatch):
    g = Gate()

    def register(ptr, n, read_only=False):
        if g.armed and threading.current_thread().name.startswith("ckptmgr-adopt"):
            with g.mu:
                k, g.adoption_pieces = g.adoption_pieces, g.adoption_pieces + 1
            if k == HELD:
                g.entered.set()
                assert g.go.wait(60)
        with g.mu:
            g.registered.add(ptr)

    def unregister(ptr):
        with g.mu:
            g.registered.discard(ptr)

    monkeypatch.setattr(cuda_shim, "available", lambda: True)
    monkeypatch.setattr(cuda_shim, "host_register", register)
    monkeypatch.setattr(cuda_shim, "host_unregister", unregister)
    monkeypatch.setattr(buffers_mod, "PIN_PIECE_BYTES", PIECE)
    real_submit, real_verify = restorer_mod.submit_image_checks, restorer_mod.verify_images
    monkeypatch.setattr(restorer_mod, "submit_image_checks",
                        lambda *a: g.checks.append("at adoption") or real_submit(*a))
    monkeypatch.setattr(restorer_mod, "verify_images", lambda *a: g.checks.append("at restore") or real_verify(*a))
    real_wait = pinning_mod.Pinning.wait

    def wait(self, name, end, deadline, budget):
        with self._cond:
            if self._upto.get(name, 0) < end:
                g.blocked.set()  # (the restore is about to wait for a piece not pinned yet)
        return real_wait(self, name, end, deadline, budget)

    monkeypatch.setattr(pinning_mod.Pinning, "wait", wait)
    yield g
    g.go.set()  # (never leave a thread at the gate)


def _open(root: str, local: str) -> CheckpointManager:
    return CheckpointManager(root, staging=StagingOptions(slots=1, local_dir=local),
                             write_options=WriteOptions(chunk_size=CHUNK), schedule=Schedule(durable_every=2))


def _leave_step_3_in_the_tier(root: str, local: str) -> str:
    """Step 2 durable, step 3 in the local tier only, kept there at close; returns the path
    of step 3's data file in the tier."""
    with _open(root, local) as mgr:
        mgr.save(2, _state(2)).result()
        mgr.save(3, _state(3)).result()
        assert mgr._tier.steps() == {3: 0}
        mgr.close(flush=False)
    return os.path.join(tier_dir(local, os.path.abspath(root)), "slot-00", "data-00000.safetensors")


def _split_at(target: dict, mgr: CheckpointManager, limit: int) -> int:
    """Check that every byte of the target's tensors that lies below file offset ``limit``
    holds step 3's value and every byte above it is still zero; return how many landed."""
    m = mgr._restorer.manifest(3)
    rec = m.files["data-00000.safetensors"]
    state = _state(3)
    landed = 0
    for name in ("a", "b", "c"):
        b, e = m.tensors[name]["offsets"]
        got, want = target[name].view(torch.uint8), state[name].view(torch.uint8)
        n = max(0, min(limit - (rec.header_size + b), e - b))
        assert torch.equal(got[:n], want[:n]), name
        assert not got[n:].any(), name
        landed += n
    return landed


def _restore_in_thread(mgr: CheckpointManager, target: dict) -> tuple[threading.Thread, list[object]]:
    out: list[object] = []

    def run() -> None:
        try:
            out.append(mgr.restore(3, target=target, loader="inplace"))
        except BaseException as exc:  # (handed to the test)
            out.append(exc)

    t = threading.Thread(target=run)
    t.start()
    return t, out


def test_a_restore_copies_the_pieces_pinned_so_far_while_the_adoption_is_held(root, ram_dir, gate):
    _leave_step_3_in_the_tier(root, ram_dir)
    gate.armed = True
    with _open(root, ram_dir) as mgr:
        assert gate.entered.wait(60)  # pieces 0 and 1 pinned, the adoption held before piece 2
        target = _target()
        restore, out = _restore_in_thread(mgr, target)
        assert gate.blocked.wait(60)  # the restore waits for piece 2
        assert restore.is_alive() and not out and mgr._saver.pool.adopting() == [0]
        assert _split_at(target, mgr, HELD * PIECE) > 0  # pieces 0 and 1 landed, nothing beyond
        with mgr._tier._mu:
            assert mgr._tier._adopting[0].hurry.is_set()  # the adoption was asked to hurry
        gate.go.set()
        restore.join(60)
        assert not restore.is_alive() and out and out[0]["n"] == 3
        for k in ("a", "b", "c"):
            assert torch.equal(target[k], _state(3)[k]), k
        assert gate.checks == ["at adoption"]  # verified once, by the checks the adoption started
        _adoption_ended(mgr)
        assert mgr._saver.pool.adopting() == [] and gate.adoption_pieces == 8
        mgr.wait(timeout=60)


def test_a_restore_holds_the_adoption_and_reads_what_is_not_pinned_from_the_far_end(root, ram_dir, gate, monkeypatch):
    """With much left to pin, a restore holds the adoption after its current piece, copies
    the chunks pinned so far from the front, and the bounce readers read the rest of the
    slot's files from the last piece back: the adoption, let go at its gate while the readers
    are held, parks after that piece and registers nothing while they read. Each byte lands
    once, verified by the adoption's checks; the adoption then pins on to the end."""
    import ckptmgr.restore.loaders.bounce as bounce_mod
    import ckptmgr.restore.loaders.images as images_mod
    from ckptmgr.restore.loaders.landing import Landing

    monkeypatch.setattr(images_mod, "BACK_FROM_BYTES", 0)
    monkeypatch.setattr(bounce_mod, "PIECE_BYTES", CHUNK)  # (a piece per checksum chunk)
    monkeypatch.setattr(bounce_mod, "THREADS", 2)
    mu = threading.Lock()
    reading, proceed, parked = threading.Event(), threading.Event(), threading.Event()
    taken: list[tuple[int, int]] = []  # (piece, adoption pieces registered or entered then)
    real_back, real_pinned, real_land = bounce_mod.Ends.back, pinning_mod.Pinning.pinned, Landing.land

    def back(self, w, k):
        reading.set()  # (the hold is taken before the readers start)
        assert proceed.wait(60)
        i = real_back(self, w, k)
        if i is not None:
            with mu:
                taken.append((i, gate.adoption_pieces))
        return i

    def pinned(self, name, upto):
        with self._cond:
            if self._held:
                parked.set()
        return real_pinned(self, name, upto)

    landed: list[tuple[int, int]] = []  # [begin, end) of the file given to a landing, each time

    def land(self, begin, src):
        with mu:
            landed.append((begin, begin + src.numel()))
        return real_land(self, begin, src)

    monkeypatch.setattr(bounce_mod.Ends, "back", back)
    monkeypatch.setattr(pinning_mod.Pinning, "pinned", pinned)
    monkeypatch.setattr(Landing, "land", land)
    _leave_step_3_in_the_tier(root, ram_dir)
    gate.armed = True
    with _open(root, ram_dir) as mgr:
        assert gate.entered.wait(60)  # pieces 0 and 1 (chunks 0-7) pinned, the adoption at its gate
        target = _target()
        restore, out = _restore_in_thread(mgr, target)
        assert reading.wait(60)
        gate.go.set()  # the adoption registers piece 2 and parks: the restore holds it
        assert parked.wait(60)
        proceed.set()
        restore.join(60)
        assert not restore.is_alive() and out and out[0]["n"] == 3, out
        for k in ("a", "b", "c"):
            assert torch.equal(target[k], _state(3)[k]), k
        assert not gate.blocked.is_set()  # the restore never waited for a piece
        size = mgr._restorer.manifest(3).files["data-00000.safetensors"].size
        pieces = -(-size // CHUNK)
        back_taken = sorted(i for i, _ in taken)
        assert back_taken == list(range(pieces - len(back_taken), pieces)) and len(back_taken) >= pieces - 12
        assert {n for _, n in taken} == {HELD + 1}  # nothing registered while the readers read
        ranges = sorted(landed)  # every byte of the file given once, by one side or the other
        assert ranges[0][0] == 0 and ranges[-1][1] == size
        assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
        assert gate.checks == ["at adoption"]
        _adoption_ended(mgr)
        assert gate.adoption_pieces == 8
        mgr.wait(timeout=60)


def test_a_restore_of_a_slot_whose_adoption_ended_copies_it_whole(root, ram_dir, gate):
    _leave_step_3_in_the_tier(root, ram_dir)
    with _open(root, ram_dir) as mgr:
        _adoption_ended(mgr)
        assert mgr._saver.pool.adopting() == [] and len(gate.registered) == 8
        target = _target()
        mgr.restore(3, target=target, loader="inplace")
        for k in ("a", "b", "c"):
            assert torch.equal(target[k], _state(3)[k]), k
        assert not gate.blocked.is_set()  # nothing waited for: the images were attached pinned


def test_a_checksum_failure_in_a_piece_not_pinned_yet_fails_the_restore_and_leaves_the_target(root, ram_dir, gate,
                                                                                               monkeypatch):
    path = _leave_step_3_in_the_tier(root, ram_dir)
    damage_last_chunk(path)  # in piece 7, while no process held the tier
    written = hold_durable_write(monkeypatch, 3)  # (that write removes the damaged step from the tier)
    gate.armed = True
    with _open(root, ram_dir) as mgr:
        assert gate.entered.wait(60)
        target = _target()
        restore, out = _restore_in_thread(mgr, target)
        restore.join(60)  # fails without waiting for the adoption
        assert not restore.is_alive() and gate.adoption_pieces == HELD + 1
        assert len(out) == 1 and isinstance(out[0], CheckpointCorruptError), out
        assert "checksum mismatch" in str(out[0]) and "step 3" in str(out[0])
        assert _untouched(target)  # no byte of the step reached the target
        assert gate.checks == ["at adoption"]
        gate.go.set()
        written.set()
        with pytest.raises(CkptError):  # the adopted step's durable write found the damage too
            mgr.wait(timeout=60)


def test_close_during_a_restore_that_waits_for_a_piece(root, ram_dir, gate):
    _leave_step_3_in_the_tier(root, ram_dir)
    gate.armed = True
    mgr = _open(root, ram_dir)
    adopter = mgr._saver.pool._adopter
    assert gate.entered.wait(60)
    mgr.wait(timeout=60)  # (the adopted step 3 is written to the root meanwhile)
    target = _target()
    restore, out = _restore_in_thread(mgr, target)
    assert gate.blocked.wait(60)
    closer = threading.Thread(target=lambda: mgr.close(timeout=0.5))
    closer.start()
    closer.join(60)
    restore.join(60)  # woken by the close: it no longer waits for the adoption
    assert not closer.is_alive() and not restore.is_alive() and len(out) == 1
    # (the files it would read instead went with the close)
    assert isinstance(out[0], ConfigError) and "closed while step 3 was restored" in str(out[0]), out
    gate.go.set()  # the registration returns: the adoption sees the close, unpins and frees the slot
    assert adopter is not None and adopter.stop(timeout=60)
    assert not gate.registered


def test_close_while_a_restore_copies_unpins_only_after_its_copies(root, ram_dir, gate, monkeypatch):
    """The adoption stops between two pieces (as at close): it revokes its progress, the
    restore ends its copies and reads the files instead, and only then is anything unpinned."""
    _leave_step_3_in_the_tier(root, ram_dir)
    gate.armed = True
    mgr = _open(root, ram_dir)
    try:
        assert gate.entered.wait(60)
        mgr.wait(timeout=60)
        with mgr._tier._mu:
            pinning = mgr._tier._adopting[0]
        copying_at_unpin: list[int] = []
        real_unregister = cuda_shim.host_unregister

        def unregister(ptr):
            with pinning._cond:
                copying_at_unpin.append(pinning._copying)
            real_unregister(ptr)

        monkeypatch.setattr(cuda_shim, "host_unregister", unregister)
        target = _target()
        restore, out = _restore_in_thread(mgr, target)
        assert gate.blocked.wait(60)
        mgr._saver.pool.stop.set()  # what close() does first: the adoption stops after this piece
        gate.go.set()
        restore.join(60)
        assert not restore.is_alive() and len(out) == 1 and out[0]["n"] == 3
        for k in ("a", "b", "c"):
            assert torch.equal(target[k], _state(3)[k]), k
        assert mgr._saver.pool.stop_adoptions(60) == []
        assert copying_at_unpin == [0, 0, 0]  # pieces 0-2 unpinned, each once no copy ran
        assert gate.adoption_pieces == HELD + 1 and not gate.registered
    finally:
        mgr.close()


def test_the_adoption_registers_each_piece_once_its_pages_are_in(root, ram_dir, gate, monkeypatch):
    """The populate threads run ahead of the registrations (not all of the slot first), and a
    piece is registered only once its own pages are in: here the pages past the first piece
    are faulted in only after the first piece is registered."""
    _leave_step_3_in_the_tier(root, ram_dir)
    populated: list[tuple[int, int]] = []  # [begin, end) of the address ranges faulted in
    mu = threading.Lock()
    first_registered = threading.Event()
    real_populate = buffers_mod._populate

    def populate(ptr, n, tensor):
        if tensor.storage_offset() >= PIECE:  # (the span's offset in its image)
            assert first_registered.wait(60)
        real_populate(ptr, n, tensor)
        with mu:
            populated.append((ptr, ptr + n))

    def covered(ptr, n):
        with mu:
            spans = sorted(populated)
        at = ptr
        for b, e in spans:
            if b <= at < e:
                at = e
        return at >= ptr + n

    real_register = cuda_shim.host_register
    unpopulated: list[int] = []

    def register(ptr, n, read_only=False):
        if threading.current_thread().name.startswith("ckptmgr-adopt"):
            if not covered(ptr, n):
                unpopulated.append(ptr)
            first_registered.set()
        real_register(ptr, n, read_only)

    monkeypatch.setattr(buffers_mod, "_populate", populate)
    monkeypatch.setattr(cuda_shim, "host_register", register)
    monkeypatch.setattr(buffers_mod, "POPULATE_PIECE_BYTES", 512)  # populated a page at a time
    monkeypatch.setattr(buffers_mod, "PIN_PAUSE_S", 0)  # (no pause that would let the populate catch up)
    with _open(root, ram_dir) as mgr:
        _adoption_ended(mgr)
        assert torch.equal(mgr.restore(3, device="cpu", loader="inplace")["a"], _state(3)["a"])
    assert len(gate.registered) == 0 and first_registered.is_set() and not unpopulated


def test_the_adoption_pauses_between_pieces_unless_a_restore_waits(root, ram_dir, gate, monkeypatch):
    _leave_step_3_in_the_tier(root, ram_dir)
    pauses: list[bool] = []  # per pause of the adoption thread: was a restore waiting then
    real_sleep = buffers_mod.time.sleep

    class _Time:
        perf_counter = staticmethod(buffers_mod.time.perf_counter)

        @staticmethod
        def sleep(s):
            pauses.append(gate.blocked.is_set())
            real_sleep(s)

    monkeypatch.setattr(buffers_mod, "time", _Time)
    gate.armed = True
    with _open(root, ram_dir) as mgr:
        assert gate.entered.wait(60)
        assert pauses == [False, False]  # before pieces 1 and 2, with nobody waiting
        target = _target()
        restore, out = _restore_in_thread(mgr, target)
        assert gate.blocked.wait(60)
        gate.go.set()
        restore.join(60)
        assert not restore.is_alive() and out and out[0]["n"] == 3
        _adoption_ended(mgr)
    assert gate.adoption_pieces == 8 and pauses == [False, False]  # none once the restore waited


def test_a_held_adoption_parks_after_its_piece_until_the_restore_lets_go_the_tier_ends_it_or_close():
    """``pinned`` publishes the piece, then parks while a restore holds the adoption; the last
    hold let go wakes it (and clears the restores' hurry), and so do ``end`` (the tier's
    close) and ``stopping`` (the manager's close)."""
    for release in ("let go", "end", "stopping"):
        p = pinning_mod.Pinning(0, {"f": torch.zeros(64, dtype=torch.uint8)})
        p.hurry.set()
        parked = threading.Event()
        real_wait_for = p._cond.wait_for

        def wait_for(predicate, timeout=None, parked=parked, real_wait_for=real_wait_for):
            parked.set()  # (under the lock, as the adoption parks)
            return real_wait_for(predicate, timeout)

        p._cond.wait_for = wait_for
        hold = p.holding()
        hold.__enter__()
        adoption = threading.Thread(target=p.pinned, args=("f", 32))
        adoption.start()
        assert parked.wait(10) and p.upto("f") == 32  # (published before it parks)
        assert adoption.is_alive()
        if release == "end":
            p.end()
        elif release == "stopping":
            p.stopping()
        else:
            hold.__exit__(None, None, None)
        adoption.join(10)
        assert not adoption.is_alive()
        assert p.hurry.is_set() == (release != "let go")
        if release != "let go":
            hold.__exit__(None, None, None)


def test_a_run_of_holds_parks_the_adoption_for_at_most_its_bound(monkeypatch):
    """Holds that outlast HOLD_WAIT_S (counted from the first) no longer park the adoption."""
    monkeypatch.setattr(pinning_mod, "HOLD_WAIT_S", 0.0)
    p = pinning_mod.Pinning(0, {"f": torch.zeros(64, dtype=torch.uint8)})
    with p.holding():
        p.pinned("f", 64)  # returns at once: the bound has passed
        assert p.upto("f") == 64


def test_close_while_a_restore_holds_the_adoption_stops_it_at_once(root, ram_dir, gate, monkeypatch):
    """The manager's close wakes an adoption parked by a restore's hold: it stops after its
    piece and revokes its progress while the restore's readers are still held (and, as for
    any restore, unpins only once the restore's copy lease is given back)."""
    import ckptmgr.restore.loaders.bounce as bounce_mod
    import ckptmgr.restore.loaders.images as images_mod

    monkeypatch.setattr(images_mod, "BACK_FROM_BYTES", 0)
    monkeypatch.setattr(bounce_mod, "PIECE_BYTES", CHUNK)
    reading, proceed, parked, revoking = threading.Event(), threading.Event(), threading.Event(), threading.Event()
    real_back, real_pinned, real_revoke = bounce_mod.Ends.back, pinning_mod.Pinning.pinned, pinning_mod.Pinning.revoke

    def back(self, w, k):
        reading.set()
        assert proceed.wait(60)
        return real_back(self, w, k)

    def pinned(self, name, upto):
        with self._cond:
            if self._held:
                parked.set()
        return real_pinned(self, name, upto)

    def revoke(self, timeout=None):
        revoking.set()
        return real_revoke(self, timeout)

    monkeypatch.setattr(bounce_mod.Ends, "back", back)
    monkeypatch.setattr(pinning_mod.Pinning, "pinned", pinned)
    monkeypatch.setattr(pinning_mod.Pinning, "revoke", revoke)
    _leave_step_3_in_the_tier(root, ram_dir)
    gate.armed = True
    mgr = _open(root, ram_dir)
    restore = None
    try:
        assert gate.entered.wait(60)
        restore, out = _restore_in_thread(mgr, _target())
        assert reading.wait(60)
        gate.go.set()
        assert parked.wait(60)  # the adoption parks after piece 2
        mgr._saver.pool.halt()  # what close() does first
        assert revoking.wait(60)  # woken: it stopped after that piece, and revokes
        assert not out and restore.is_alive() and gate.adoption_pieces == HELD + 1
    finally:
        proceed.set()
        if restore is not None:
            restore.join(60)
        mgr.close()
    assert not restore.is_alive() and len(out) == 1 and out[0]["n"] == 3, out


def _open_under(directory: str) -> list[str]:
    """The files under ``directory`` this process has descriptors of, one entry per descriptor."""
    real = os.path.realpath(directory) + os.sep
    out = []
    for n in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{n}")
        except OSError:  # (closed meanwhile: the listing's own descriptor)
            continue
        if target.startswith(real):
            out.append(target)
    return sorted(out)


@pytest.mark.parametrize("fails", ["front", "drain"])
def test_a_restore_that_fails_while_holding_releases_the_hold_and_the_slot_files(root, ram_dir, gate, monkeypatch,
                                                                                  fails):
    """Whatever fails in a restore that holds the adoption (its front copies, or the readers'
    drain in its cleanup), the hold is released and the slot's files it opened are closed by
    the time the error reaches the caller (the error still alive), and the adoption ends."""
    import ckptmgr.restore.loaders.bounce as bounce_mod
    import ckptmgr.restore.loaders.images as images_mod

    monkeypatch.setattr(images_mod, "BACK_FROM_BYTES", 0)
    monkeypatch.setattr(bounce_mod, "PIECE_BYTES", CHUNK)
    if fails == "front":
        def front(*a, **k):
            raise RuntimeError("a copy failed")
        monkeypatch.setattr(images_mod, "_front", front)
    else:
        real_drain = bounce_mod.Readers.drain

        def drain(self):
            real_drain(self)
            raise RuntimeError("the readers' drain failed")
        monkeypatch.setattr(bounce_mod.Readers, "drain", drain)
    started: list[bounce_mod.Readers] = []
    real_start = bounce_mod.start_readers
    monkeypatch.setattr(bounce_mod, "start_readers", lambda *a, **k: started.append(real_start(*a, **k)) or started[-1])
    path = _leave_step_3_in_the_tier(root, ram_dir)
    gate.armed = True
    with _open(root, ram_dir) as mgr:
        assert gate.entered.wait(60)
        with mgr._tier._mu:
            pinning = mgr._tier._adopting[0]
        before = _open_under(os.path.dirname(path))  # (the tier's own)
        restore, out = _restore_in_thread(mgr, _target())
        restore.join(60)
        assert not restore.is_alive() and len(out) == 1 and isinstance(out[0], RuntimeError), out
        with pinning._cond:
            assert pinning._held == 0
        assert _open_under(os.path.dirname(path)) == before
        assert len(started) == 1 and all(f.done() for f in started[0]._runs)  # no reader outlived it
        gate.go.set()
        _adoption_ended(mgr)
        assert gate.adoption_pieces == 8


@pytest.mark.parametrize("why", ["readers", "replaced"])
def test_a_restore_whose_readers_cannot_start_waits_for_the_pinning_and_keeps_nothing(root, ram_dir, gate,
                                                                                   monkeypatch, caplog, why):
    """Where the readers do not start (no pinned memory for them) or a slot file is not the file
    the image maps (replaced by one of the same size), the restore takes no hold, keeps no
    descriptor, says why, and copies it all from the front as the adoption pins it: bit-exact."""
    import shutil

    import ckptmgr.restore.loaders.bounce as bounce_mod
    import ckptmgr.restore.loaders.images as images_mod

    monkeypatch.setattr(images_mod, "BACK_FROM_BYTES", 0)
    monkeypatch.setattr(bounce_mod, "PIECE_BYTES", CHUNK)
    path = _leave_step_3_in_the_tier(root, ram_dir)
    if why == "readers":
        def no_readers(*a, **k):
            raise RuntimeError("no pinned memory for the readers")
        monkeypatch.setattr(bounce_mod, "start_readers", no_readers)
    gate.armed = True
    with _open(root, ram_dir) as mgr:
        assert gate.entered.wait(60)
        if why == "replaced":  # (the same bytes in a new file: the mapping keeps the old one)
            shutil.copyfile(path, path + ".new")
            os.replace(path + ".new", path)
        with mgr._tier._mu:
            pinning = mgr._tier._adopting[0]
        before = _open_under(os.path.dirname(path))
        target = _target()
        with caplog.at_level("WARNING", logger="ckptmgr"):
            restore, out = _restore_in_thread(mgr, target)
            assert gate.blocked.wait(60)  # it waits for piece 2, holding nothing
            with pinning._cond:
                assert pinning._held == 0
            assert _open_under(os.path.dirname(path)) == before
            gate.go.set()
            restore.join(60)
        assert not restore.is_alive() and out and out[0]["n"] == 3, out
        for k in ("a", "b", "c"):
            assert torch.equal(target[k], _state(3)[k]), k
        said = "no pinned memory" if why == "readers" else "is not the file the image maps"
        assert any("not read beside its pinning" in r.getMessage() and said in r.getMessage()
                   for r in caplog.records), [r.getMessage() for r in caplog.records]
        _adoption_ended(mgr)
        mgr.wait(timeout=60)


def test_a_held_adoption_s_page_faulting_threads_start_no_span_until_the_restore_lets_go(root, ram_dir, monkeypatch):
    """The adoption's populate threads park before their next span while a restore holds the
    adoption: the span after the one running when the hold began is faulted in only once the
    restore has let go."""
    import ckptmgr.restore.loaders.bounce as bounce_mod
    import ckptmgr.restore.loaders.images as images_mod

    monkeypatch.setattr(cuda_shim, "available", lambda: True)
    monkeypatch.setattr(cuda_shim, "host_register", lambda ptr, n, read_only=False: None)
    monkeypatch.setattr(cuda_shim, "host_unregister", lambda ptr: None)
    monkeypatch.setattr(buffers_mod, "PIN_PIECE_BYTES", PIECE)
    monkeypatch.setattr(buffers_mod, "POPULATE_PIECE_BYTES", PIECE // 8)  # (spans of one pinned piece)
    monkeypatch.setattr(buffers_mod, "POPULATE_THREADS", 1)
    monkeypatch.setattr(images_mod, "BACK_FROM_BYTES", 0)
    monkeypatch.setattr(bounce_mod, "PIECE_BYTES", CHUNK)
    mu = threading.Lock()
    spans: list[tuple[int, bool]] = []  # (span, the adoption held when it began)
    second_in, second_go = threading.Event(), threading.Event()
    reading, proceed, pop_parked = threading.Event(), threading.Event(), threading.Event()
    real_populate, real_back, real_unheld = buffers_mod._populate, bounce_mod.Ends.back, pinning_mod.Pinning.unheld
    holder: list[pinning_mod.Pinning] = []

    def populate(ptr, nbytes, tensor):
        with mu:
            k = len(spans)
            held = bool(holder) and holder[0]._held > 0
            spans.append((k, held))
        if k == 1:  # the second span runs when the restore takes its hold
            second_in.set()
            assert second_go.wait(60)
        real_populate(ptr, nbytes, tensor)

    def unheld(self):
        if threading.current_thread().name.startswith("ckptmgr-populate"):
            with self._cond:
                if self._held:
                    pop_parked.set()
        return real_unheld(self)

    def back(self, w, k):
        reading.set()
        assert proceed.wait(60)
        return real_back(self, w, k)

    monkeypatch.setattr(buffers_mod, "_populate", populate)
    monkeypatch.setattr(pinning_mod.Pinning, "unheld", unheld)
    monkeypatch.setattr(bounce_mod.Ends, "back", back)
    _leave_step_3_in_the_tier(root, ram_dir)
    with _open(root, ram_dir) as mgr:
        try:
            assert second_in.wait(60)  # piece 0 populated (and pinned), the second span running
            with mgr._tier._mu:
                holder.append(mgr._tier._adopting[0])
            restore, out = _restore_in_thread(mgr, _target())
            assert reading.wait(60)  # the restore holds the adoption
            second_go.set()
            assert pop_parked.wait(60)  # the populate thread parks before the third span
            with mu:
                assert [k for k, _ in spans] == [0, 1]
            proceed.set()
            restore.join(60)
            assert not restore.is_alive() and out and out[0]["n"] == 3, out
            _adoption_ended(mgr)
            with mu:  # (every span of the slot's buffers ran, none while the adoption was held)
                assert len(spans) > 2 and not any(held for k, held in spans if k >= 2)
        finally:
            second_go.set()
            proceed.set()


def test_the_threads_that_fault_pages_in_ahead_start_no_span_while_paused(monkeypatch):
    """``PopulateAhead``'s ``pause`` (the adoption's: a restore holds it) is called before each
    span; no span is faulted in until it returns, then every one is."""
    monkeypatch.setattr(cuda_shim, "available", lambda: True)
    monkeypatch.setattr(buffers_mod, "POPULATE_PIECE_BYTES", 4096)  # (spans of 32 KiB)
    buf = buffers_mod.anonymous_buffer(8 * 32 << 10)
    mu = threading.Lock()
    populated: list[int] = []
    paused, go = threading.Semaphore(0), threading.Event()
    real = buffers_mod._populate

    def populate(ptr, nbytes, tensor):
        with mu:
            populated.append(nbytes)
        real(ptr, nbytes, tensor)

    def pause():
        paused.release()
        assert go.wait(60)

    monkeypatch.setattr(buffers_mod, "_populate", populate)
    ahead = buffers_mod.PopulateAhead([buf], threads=3, pause=pause)
    try:
        for _ in range(3):  # every thread is in its first span's pause
            assert paused.acquire(timeout=60)
        with mu:
            assert populated == []
        go.set()
        ahead.wait(buf, buf.nbytes)
        assert sum(populated) == buf.nbytes
    finally:
        go.set()
        ahead.close()
