"""What a walk reads of its `PlanWalker` (`WalkKit`): the settings and the services, shared
by every request, in one object the walker builds once (walker.py imports this module and
the walk, the walk this one; nothing here knows of a request)."""

from __future__ import annotations

from typing import final

from fallback_mw.capacity import CapacityState
from fallback_mw.config.views import SettingsView
from fallback_mw.faults import FaultSource
from fallback_mw.health import HealthState
from fallback_mw.layers.walker.via import ViaSecret
from fallback_mw.shadow import ShadowTraffic
from fallback_mw.telemetry import Telemetry
from fallback_mw.upstream.base import UpstreamClient


@final
class WalkKit:
    """A native class when compiled: a walk reads each field as a C struct member, where a
    read of the walker itself (a Python class, weakly referenced) is a generic attribute
    look-up of some 200 instructions, a dozen a request. Built once per walker
    (`PlanWalker.__init__`): the walker's services do not change under it."""

    __slots__ = (
        "capacity",
        "client",
        "faults",
        "health",
        "settings",
        "shadows",
        "telemetry",
        "via_secret",
    )

    def __init__(
        self,
        settings: SettingsView,
        client: UpstreamClient,
        faults: FaultSource,
        health: HealthState,
        capacity: CapacityState,
        telemetry: Telemetry,
        shadows: ShadowTraffic,
        via_secret: ViaSecret,
    ) -> None:
        self.settings = settings
        self.client = client
        self.faults = faults
        self.health = health
        self.capacity = capacity
        self.telemetry = telemetry
        self.shadows = shadows
        self.via_secret = via_secret
