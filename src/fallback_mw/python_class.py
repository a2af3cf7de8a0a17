"""`@python_class`: a class that stays a Python class when its module is compiled with mypyc
(scripts/compile.py, opt-in). mypyc makes every class it can a native class, which has no
`__weakref__` slot: the gateway, the plan walker and telemetry are weakly referenced (they
close what they own when dropped). A class decorated with anything but mypyc's own
decorators stays a Python class whose methods are still compiled. Interpreted, it does
nothing."""

from __future__ import annotations

from typing import TypeVar

T = TypeVar("T", bound=type)


def python_class(cls: T) -> T:
    return cls
