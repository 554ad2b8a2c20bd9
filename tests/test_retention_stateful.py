"""Random sequences of saves, crashes (mid-save and mid-delete), restarts, protections and
retention runs, on a local root and on an fsspec root. After every operation:

* the newest committed step exists and restores, byte for byte;
* exactly the steps a model of the policy keeps exist (so every step the policy keeps does);
* nothing that is not ours was touched.
"""

import os
import shutil
import tempfile

import fsspec
import hypothesis.strategies as st
import torch
from conftest import assert_tree_equal
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from test_fsspec_target import FaultyFS

from ckptmgr import AnyOf, CheckpointManager, KeepBest, KeepEvery, KeepLatest, StagingOptions, StepInfo
from ckptmgr.format.naming import step_name, temp_name

policies = st.lists(
    st.one_of(
        st.builds(KeepLatest, st.integers(0, 3)),
        st.builds(KeepEvery, st.integers(1, 12)),
        st.builds(KeepBest, st.integers(0, 2), st.just("loss"), st.sampled_from(["min", "max"])),
    ),
    min_size=1, max_size=3,
).map(lambda ps: AnyOf(*ps))


def state_of(step: int) -> dict:
    return {"w": torch.arange(4, dtype=torch.float32) + step, "step": step}


class RetentionMachine(RuleBasedStateMachine):
    url: str  # set by subclasses' setup
    storage_options: dict | None = None

    def setup_root(self) -> None:
        """Set ``self.url`` (and ``storage_options``) to a fresh root. Each backend's subclass
        provides it; this base machine is never run itself (only the subclasses' TestCase)."""
        raise NotImplementedError("a RetentionMachine subclass names the root")

    @initialize(policy=policies)
    def start(self, policy):
        self.setup_root()
        self.policy = policy
        self.fs, self.path = fsspec.core.url_to_fs(self.url, **(self.storage_options or {}))
        self.fs.makedirs(self.path, exist_ok=True)
        self.foreign = [f"{self.path}/README.txt", f"{self.path}/step_7/user.bin"]
        for f in self.foreign:
            self.fs.makedirs(f.rsplit("/", 1)[0], exist_ok=True)
            self.fs.pipe_file(f, b"not ckptmgr's")
        self.alive: dict[int, float] = {}  # the model: step -> loss metric
        self.protected: set[int] = set()
        self.next_step = 0
        self.mgr = self.open()

    def open(self) -> CheckpointManager:
        return CheckpointManager(self.url, retention=self.policy, staging=StagingOptions(local_tier=False),
                                 storage_options=self.storage_options)

    def model_delete(self) -> None:
        steps = sorted(self.alive)
        infos = [StepInfo(s, 0.0, {"loss": self.alive[s]}) for s in steps]
        keep = self.policy.keep(infos)
        for s, k in zip(steps, keep, strict=True):
            if not k and s != steps[-1] and s not in self.protected:
                del self.alive[s]

    @rule(gap=st.integers(1, 7), loss=st.floats(0, 10, allow_nan=False))
    def save(self, gap, loss):
        step = self.next_step + gap - 1
        self.next_step = step + 1
        self.mgr.save(step, state_of(step), metadata={"loss": loss}).result(timeout=30)
        self.mgr.wait(timeout=30)
        self.alive[step] = loss
        self.model_delete()

    @rule()
    def restart(self):
        self.mgr.close(timeout=30)
        self.mgr = self.open()

    @rule()
    def crash_mid_save(self):
        """A save interrupted before its commit: half-written files, no commit record."""
        step = self.next_step
        self.next_step += 1
        d = self.leftover_dir(step)
        self.fs.makedirs(d, exist_ok=True)
        self.fs.pipe_file(f"{d}/data-00000.safetensors", b"partial")
        self.fs.invalidate_cache()
        self.restart()

    @rule(data=st.data())
    def crash_mid_delete(self, data):
        """A delete interrupted right after the commit record went (of a step the deleter
        would delete if the policy changed to KeepLatest(1) for one run)."""
        victims = [s for s in sorted(self.alive)[:-1] if s not in self.protected]
        if not victims:
            return
        step = data.draw(st.sampled_from(victims))
        self.fs.rm_file(f"{self.path}/{step_name(step)}/manifest.json")
        self.fs.invalidate_cache()
        del self.alive[step]
        self.restart()

    @rule(data=st.data())
    def user_file_in_a_step(self, data):
        """Users put their own files beside ours (eval results...): those must survive."""
        if not self.alive:
            return
        step = data.draw(st.sampled_from(sorted(self.alive)))
        f = f"{self.path}/{step_name(step)}/eval-{len(self.foreign)}.json"
        self.fs.pipe_file(f, b"not ckptmgr's")
        self.foreign.append(f)

    @rule(data=st.data(), on=st.booleans())
    def protect(self, data, on):
        if not self.alive:
            return
        step = data.draw(st.sampled_from(sorted(self.alive)))
        if on:
            self.mgr.protect(step)
            self.protected.add(step)
        else:
            self.mgr.unprotect(step)
            self.protected.discard(step)

    @invariant()
    def exactly_the_kept_steps_exist_and_the_newest_restores(self):
        if not hasattr(self, "mgr"):
            return
        assert self.mgr.steps() == sorted(self.alive)
        if self.alive:
            newest = max(self.alive)
            assert_tree_equal(self.mgr.restore(), state_of(newest))

    @invariant()
    def foreign_files_untouched(self):
        if hasattr(self, "foreign"):
            for f in self.foreign:
                assert self.fs.cat_file(f) == b"not ckptmgr's", f

    def teardown(self):
        if hasattr(self, "mgr"):
            self.mgr.close(timeout=30)
        self.cleanup_root()

    def leftover_dir(self, step: int) -> str:
        """Where an interrupted save of ``step`` leaves its files on this backend (a temporary
        directory locally, the step's own prefix on object stores). Provided per subclass."""
        raise NotImplementedError("a RetentionMachine subclass says where saves leave leftovers")

    def cleanup_root(self) -> None:
        pass


class LocalRetention(RetentionMachine):
    def setup_root(self):
        self.tmp = tempfile.mkdtemp(prefix="ckptmgr-retention-")
        self.url = os.path.join(self.tmp, "root")

    def leftover_dir(self, step):
        return f"{self.path}/{temp_name(step)}"  # local saves write a temporary directory

    def cleanup_root(self):
        shutil.rmtree(self.tmp, ignore_errors=True)


class FsspecRetention(RetentionMachine):
    def setup_root(self):
        FaultyFS.store.clear()
        FaultyFS.pseudo_dirs.clear()
        FaultyFS.pseudo_dirs.append("")
        self.url = "faulty://retention"

    def leftover_dir(self, step):
        return f"{self.path}/{step_name(step)}"  # object stores write in place, manifest last


_moto: list = []


class S3Retention(RetentionMachine):
    """The same machine on S3: moto's server on 127.0.0.1, one fresh bucket per example."""

    def setup_root(self):
        import s3fs
        from s3_proxy import start_moto

        if not _moto:
            _moto.append(start_moto())
        endpoint = _moto[0][1]
        self.storage_options = {"endpoint_url": endpoint, "key": "testing", "secret": "testing"}
        bucket = f"ret-{os.getpid()}-{len(_moto)}"
        _moto.append(bucket)
        s3fs.S3FileSystem(**self.storage_options).mkdir(bucket)
        self.url = f"s3://{bucket}/run"

    def leftover_dir(self, step):
        return f"{self.path}/{step_name(step)}"


_settings = settings(max_examples=100, stateful_step_count=30, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow])
TestLocalRetention = LocalRetention.TestCase
TestLocalRetention.settings = _settings
TestFsspecRetention = FsspecRetention.TestCase
TestFsspecRetention.settings = _settings

s3fs_available = True
try:
    import s3fs  # noqa: F401
except ImportError:  # pragma: no cover
    s3fs_available = False
if s3fs_available:
    TestS3Retention = S3Retention.TestCase
    # (each example runs against a real S3 server: 5 keep the suite's time; CKPTMGR_S3_EXAMPLES=N for more)
    TestS3Retention.settings = settings(_settings, max_examples=int(os.environ.get("CKPTMGR_S3_EXAMPLES", "5")))
