import os

import pytest

import ckptmgr

EXPECTED = [
    "AnyOf",
    "CapacityError",
    "CheckpointCorruptError",
    "CheckpointManager",
    "CkptError",
    "CkptTimeoutError",
    "ConfigError",
    "FormatVersionError",
    "KeepAll",
    "KeepBest",
    "KeepEvery",
    "KeepEverySeconds",
    "KeepLatest",
    "PeerOptions",
    "PerRank",
    "PinnedWeights",
    "RetentionPolicy",
    "S3Options",
    "SaveError",
    "SaveHandle",
    "SaveInfo",
    "SaveSkippedError",
    "Schedule",
    "StagingOptions",
    "StateMismatchError",
    "StepExistsError",
    "StepInfo",
    "StepNotFoundError",
    "StorageError",
    "UnsupportedValueError",
    "WriteOptions",
    "__version__",
    "load_file",
    "pin_file",
]


def test_public_names_are_pinned():
    assert ckptmgr.__all__ == EXPECTED
    assert sorted(ckptmgr.__all__) == ckptmgr.__all__
    for name in ckptmgr.__all__:
        assert hasattr(ckptmgr, name), name


def test_public_classes_say_they_belong_to_ckptmgr():
    for name in ckptmgr.__all__:
        obj = getattr(ckptmgr, name)
        if isinstance(obj, type):
            assert obj.__module__.startswith("ckptmgr"), name
            assert obj.__doc__, f"{name} has no docstring"


def test_error_tree_derives_from_builtins():
    e = ckptmgr
    assert issubclass(e.StepNotFoundError, FileNotFoundError)
    assert issubclass(e.StepExistsError, FileExistsError)
    assert issubclass(e.CheckpointCorruptError, ValueError)
    assert issubclass(e.StateMismatchError, ValueError)
    assert issubclass(e.UnsupportedValueError, TypeError)
    assert issubclass(e.SaveError, RuntimeError)
    assert issubclass(e.CkptTimeoutError, TimeoutError)
    assert issubclass(e.StorageError, OSError)
    for name in ckptmgr.__all__:
        obj = getattr(ckptmgr, name)
        if isinstance(obj, type) and issubclass(obj, BaseException):
            assert issubclass(obj, e.CkptError) and issubclass(obj, Exception), name


@pytest.mark.skipif(not os.environ.get("CKPTMGR_REQUIRE_INSTALLED"), reason="only checked in CI")
def test_tests_run_against_the_installed_package():
    assert "site-packages" in ckptmgr.__file__, ckptmgr.__file__
