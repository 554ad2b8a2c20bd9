import os

import pytest

import ckptmgr
import ckptmgr.extend

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


EXTEND_EXPECTED = [
    "DTYPE_TO_ST",
    "RECORD_NAME",
    "AsyncWriter",
    "BudgetPlanner",
    "Commit",
    "Destinations",
    "DirectoryCommit",
    "Fifo",
    "FileCommit",
    "FilePlan",
    "FileRecord",
    "Image",
    "JobPicker",
    "Pending",
    "StoredTensor",
    "TorchZipImage",
    "chunk_ranges",
    "committed_dirs",
    "coordinator_for",
    "crc32c_hex",
    "delete_dir",
    "dir_temp_name",
    "header_bytes",
    "newest_verified",
    "option_or_default",
    "plan_image",
    "read_record",
    "recover",
    "remove_stale_temps",
    "replace_dir",
    "scratch_dir",
    "seal",
    "verify_dir",
    "verify_file",
    "write_record",
]


def test_extension_names_are_pinned():
    assert ckptmgr.extend.__all__ == EXTEND_EXPECTED
    for name in ckptmgr.extend.__all__:
        assert hasattr(ckptmgr.extend, name), name
    assert not set(ckptmgr.extend.__all__) & set(ckptmgr.__all__)  # the public API is not repeated there


def test_extension_classes_and_functions_are_documented():
    for name in ckptmgr.extend.__all__:
        obj = getattr(ckptmgr.extend, name)
        if isinstance(obj, type) or callable(obj):
            assert obj.__module__.startswith("ckptmgr"), name
            assert obj.__doc__, f"{name} has no docstring"
    assert "Experimental" in (ckptmgr.extend.__doc__ or "")
