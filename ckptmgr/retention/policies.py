"""Retention policies: which committed steps to keep.

A policy is a small frozen object with one pure method, :meth:`RetentionPolicy.keep`, that
maps the committed steps (ascending, with commit time and user metadata) to a keep-mask.
Policies compose with :class:`AnyOf`. They decide only; the manager's deleter acts, and it
never deletes the newest committed step, a protected step, or a step being restored,
whatever a policy says.

Policies take whatever the manifests say: a metric that is not a real number within float
range (``10**400``, NaN, a string, missing) is "no metric", and a commit time that is not a
finite number is "no time"; neither ever makes a policy raise.

Example:
    >>> from ckptmgr import AnyOf, KeepEvery, KeepLatest, StepInfo
    >>> policy = AnyOf(KeepLatest(2), KeepEvery(1000))
    >>> steps = [StepInfo(s, time=0.0) for s in (500, 1100, 1500, 2050, 2600, 2900)]
    >>> [s.step for s, keep in zip(steps, policy.keep(steps)) if keep]
    [1100, 2050, 2600, 2900]
"""

from __future__ import annotations

import math
import numbers
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError

__all__ = ["AnyOf", "KeepAll", "KeepBest", "KeepEvery", "KeepEverySeconds", "KeepLatest", "RetentionPolicy",
           "StepInfo"]


@dataclass(frozen=True)
class StepInfo:
    """What a policy knows about one committed step.

    Attributes:
        step: the step number.
        time: commit wall time (seconds since the epoch).
        metadata: the user metadata saved with the step.
    """

    step: int
    time: float
    metadata: Mapping[str, Any] = field(default_factory=dict)


class RetentionPolicy(ABC):
    """Base of every policy: a pure function from committed steps to a keep-mask."""

    @abstractmethod
    def keep(self, steps: Sequence[StepInfo]) -> list[bool]:
        """One bool per step of ``steps`` (ascending by step): True to keep it."""


def _finite(value: Any) -> float | None:
    """``value`` as a finite float, or None when it is not a real number within float range."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    try:
        f = float(value)
    except (OverflowError, ValueError, TypeError):  # an int beyond float range, an odd Real
        return None
    return f if math.isfinite(f) else None


def _count(name: str, value: Any, *, positive: bool) -> None:
    if type(value) is not int or value < (1 if positive else 0):
        need = "a positive int" if positive else "an int >= 0"
        raise ConfigError(f"{name} must be {need}, got {value!r}")


@dataclass(frozen=True)
class KeepAll(RetentionPolicy):
    """Keep every step (the default: nothing is deleted unless you ask)."""

    def keep(self, steps: Sequence[StepInfo]) -> list[bool]:
        return [True] * len(steps)


@dataclass(frozen=True)
class KeepLatest(RetentionPolicy):
    """Keep the newest ``n`` steps."""

    n: int

    def __post_init__(self) -> None:
        _count("KeepLatest(n)", self.n, positive=False)

    def keep(self, steps: Sequence[StepInfo]) -> list[bool]:
        first = len(steps) - self.n
        return [i >= first for i in range(len(steps))]


@dataclass(frozen=True)
class KeepEvery(RetentionPolicy):
    """The periodic archive: in each window of steps ``[m*k, (m+1)*k)``, m >= 1, keep the first
    committed step. Saves need not land on multiples of ``k``."""

    k: int

    def __post_init__(self) -> None:
        _count("KeepEvery(k)", self.k, positive=True)

    def keep(self, steps: Sequence[StepInfo]) -> list[bool]:
        seen: set[int] = set()
        mask = []
        for s in steps:
            window = s.step // self.k
            mask.append(window >= 1 and window not in seen)
            seen.add(window)
        return mask


@dataclass(frozen=True)
class KeepEverySeconds(RetentionPolicy):
    """In each window of commit wall time ``[m*s, (m+1)*s)`` seconds since the epoch, keep
    the first committed step: an archive every ``s`` seconds of training."""

    seconds: float

    def __post_init__(self) -> None:
        ok = isinstance(self.seconds, (int, float)) and not isinstance(self.seconds, bool)
        if not ok or not math.isfinite(self.seconds) or self.seconds <= 0:
            raise ConfigError(f"KeepEverySeconds(seconds) must be a positive number, got {self.seconds!r}")

    def keep(self, steps: Sequence[StepInfo]) -> list[bool]:
        """Steps whose time is not a finite number belong to no window (this policy keeps none of them)."""
        first: dict[int, tuple[float, int, int]] = {}  # window -> (time, step, index) of its first step
        for i, s in enumerate(steps):
            t = _finite(s.time)
            if t is None:
                continue
            w = t / self.seconds
            if not math.isfinite(w):  # a huge time over a tiny window
                continue
            key = math.floor(w)
            if key not in first or (t, s.step) < first[key][:2]:
                first[key] = (t, s.step, i)
        chosen = {i for _, _, i in first.values()}
        return [i in chosen for i in range(len(steps))]


@dataclass(frozen=True)
class KeepBest(RetentionPolicy):
    """Keep the ``n`` steps with the best value of ``metadata[metric]`` (``mode="min"``: lowest).

    Steps without the metric, or with a value that is not a real number within float range
    (NaN, inf, ``10**400``, a string, a list), are never "best". Ties go to the newer step.
    """

    n: int
    metric: str
    mode: str = "min"

    def __post_init__(self) -> None:
        _count("KeepBest(n)", self.n, positive=False)
        if not isinstance(self.metric, str) or not self.metric:
            raise ConfigError(f"KeepBest(metric) must be a non-empty str, got {self.metric!r}")
        if self.mode not in ("min", "max"):
            raise ConfigError(f"KeepBest(mode) must be 'min' or 'max', got {self.mode!r}")

    def keep(self, steps: Sequence[StepInfo]) -> list[bool]:
        scored = []
        for i, s in enumerate(steps):
            v = _finite(s.metadata.get(self.metric)) if isinstance(s.metadata, Mapping) else None
            if v is not None:
                scored.append(((v if self.mode == "min" else -v), -s.step, i))
        chosen = {i for _, _, i in sorted(scored)[:self.n]}
        return [i in chosen for i in range(len(steps))]


@dataclass(frozen=True, init=False)
class AnyOf(RetentionPolicy):
    """Keep what any of ``policies`` keeps.

    Example:
        >>> AnyOf(KeepLatest(3), KeepEvery(1000), KeepBest(1, "val_loss"))  # doctest: +ELLIPSIS
        AnyOf(policies=(KeepLatest(n=3), KeepEvery(k=1000), KeepBest(...)))
    """

    policies: tuple[RetentionPolicy, ...]

    def __init__(self, *policies: RetentionPolicy) -> None:
        if not policies:
            raise ConfigError("AnyOf() needs at least one policy")
        for p in policies:
            if not isinstance(p, RetentionPolicy):
                raise ConfigError(f"AnyOf() takes retention policies, got {type(p).__name__}")
        object.__setattr__(self, "policies", tuple(policies))

    def keep(self, steps: Sequence[StepInfo]) -> list[bool]:
        mask = [False] * len(steps)
        for p in self.policies:
            sub = p.keep(steps)
            if len(sub) != len(steps):
                raise ValueError(f"{p!r} returned {len(sub)} decisions for {len(steps)} steps")
            mask = [a or b for a, b in zip(mask, sub, strict=True)]
        return mask
