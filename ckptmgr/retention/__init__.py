"""Retention: which committed steps to keep (the policies, public) and the deleter that
applies them in the background (:mod:`.deleter`).

Example:
    >>> from ckptmgr.retention import AnyOf, KeepEvery, KeepLatest, StepInfo
    >>> policy = AnyOf(KeepLatest(2), KeepEvery(1000))
    >>> steps = [StepInfo(s, time=0.0) for s in (500, 1100, 1500, 2050, 2600, 2900)]
    >>> [s.step for s, keep in zip(steps, policy.keep(steps)) if keep]
    [1100, 2050, 2600, 2900]
"""

from .policies import AnyOf, KeepAll, KeepBest, KeepEvery, KeepEverySeconds, KeepLatest, RetentionPolicy, StepInfo

__all__ = ["AnyOf", "KeepAll", "KeepBest", "KeepEvery", "KeepEverySeconds", "KeepLatest", "RetentionPolicy",
           "StepInfo"]
