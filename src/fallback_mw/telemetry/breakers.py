"""The breaker state a gateway reports (SPEC §9: breaker state is a metric): the
`gateway.breaker.state` gauge (0 closed, 1 half-open, 2 open) for the upstreams each
gateway serves, and `gateway.breaker.transitions`. The health state calls these hooks on
every transition; Telemetry (telemetry/core.py) carries them."""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Collection, Iterable, Mapping

from opentelemetry import metrics

from fallback_mw.telemetry.instruments import Instruments
from fallback_mw.telemetry.redact import label

_internal = logging.getLogger("fallback_mw.telemetry")

_BREAKER_VALUES = {"closed": 0, "half_open": 1, "open": 2}

# Every live gateway's reports, for the breaker gauge (BreakerReports._observe_breakers).
_LIVE: weakref.WeakSet[BreakerReports] = weakref.WeakSet()


def normalise_breaker_state(state: str) -> str | None:
    normalised = state.strip().lower().replace("-", "_")
    return normalised if normalised in _BREAKER_VALUES else None


class BreakerReports:
    """Telemetry's breaker hooks and gauge. Every hook is safe to call and never raises."""

    meter_provider: metrics.MeterProvider
    _m: Instruments

    def _start_breaker_reports(self, meter: metrics.Meter) -> None:
        # This gateway's breakers (its own health state reports to it), so two Gateways on
        # two meter providers keep separate gauges. On one provider (the host's global one)
        # the SDK keeps the first gateway's gauge and drops a second registration's
        # callback: each gauge callback reports every live gateway on its provider.
        self._breaker_states: dict[str, str] = {}
        _LIVE.add(self)
        # The upstreams each gateway reporting here serves (only_upstreams): its file's,
        # or with a route store those it still serves after the last reload.
        self._serving: list[Callable[[], Collection[str]]] = []
        meter.create_observable_gauge(
            "gateway.breaker.state",
            callbacks=[self._observe_breakers],
            unit="{state}",
            description="Breaker state per upstream: 0 closed, 1 half-open, 2 open",
        )

    def breaker_state(self, upstream: str, state: str) -> None:
        """Report an upstream's breaker state (`closed`, `half_open`/`half-open`, `open`);
        the health state calls it on every transition (again with the same state is
        harmless). Exported as the `gateway.breaker.state` gauge (0 closed, 1 half-open,
        2 open); each change counts in `gateway.breaker.transitions`. Never raises."""
        try:
            normalised = normalise_breaker_state(state)
            if normalised is None:
                return
            name = label(upstream)
            previous = self._breaker_states.get(name)
            self._breaker_states[name] = normalised
            if previous != normalised:
                self._m.transitions.add(
                    1, {"gateway.upstream": name, "gateway.breaker.state": normalised}
                )
        except Exception:
            _internal.debug("breaker state not recorded", exc_info=False)

    def breaker_seen(self, upstream: str, state: str) -> None:
        """A shared breaker's state that another process moved it to (Redis state): the
        gauge follows it, `gateway.breaker.transitions` does not count it, so that summed
        over every process each transition counts once. Never raises."""
        try:
            normalised = normalise_breaker_state(state)
            if normalised is not None:
                self._breaker_states[label(upstream)] = normalised
        except Exception:
            _internal.debug("breaker state not recorded", exc_info=False)

    def breaker_states(self) -> Mapping[str, str]:
        """The last reported state of each upstream's breaker (a copy)."""
        return dict(self._breaker_states)

    def only_upstreams(self, serving: Callable[[], Collection[str]]) -> None:
        """Report the breaker gauge for the upstreams `serving()` names (a gateway calls it
        once; two gateways sharing this Telemetry report both sets): each from the start,
        0 (closed) until its breaker moves (SPEC §9: breaker state is a metric, and a
        healthy gateway had no series at all); and only those: when a route store reload
        drops an upstream, its series goes, so an open breaker of a removed upstream does
        not keep FallbackMwBreakerOpen firing until a restart. Its last state is kept: an
        upstream added back reports it again."""
        self._serving.append(serving)

    def _serving_labels(self) -> set[str] | None:
        """The labels of the upstreams `only_upstreams` names; None: report every one."""
        if not self._serving:
            return None
        try:
            return {label(name) for serving in self._serving for name in serving()}
        except Exception:
            _internal.debug("serving upstreams not read", exc_info=False)
            return None

    def _observe_breakers(self, options: metrics.CallbackOptions) -> Iterable[metrics.Observation]:
        """The breakers of every live gateway whose instruments are on this one's meter
        provider (the one registration of the gauge the SDK kept reports them all), after
        adding their tallied counts to the counters; an
        upstream name two of them use reports its worst state. A gateway reports the
        upstreams it serves (`only_upstreams`), a breaker that never moved as closed."""
        provider = _resolved(self.meter_provider)
        values: dict[str, int] = {}
        for telemetry in list(_LIVE):
            if telemetry is not self and _resolved(telemetry.meter_provider) is not provider:
                continue
            # Every collection runs the callbacks before it reads the counters: the counts
            # the tallies hold (instruments.Tally) are added now, and read in this one.
            telemetry._m.flush()
            serving = telemetry._serving_labels()
            for upstream, state in list(telemetry._breaker_states.items()):
                if serving is None or upstream in serving:
                    values[upstream] = max(values.get(upstream, 0), _BREAKER_VALUES[state])
            for upstream in serving or ():
                values.setdefault(upstream, _BREAKER_VALUES["closed"])  # never moved yet
        return [
            metrics.Observation(value, {"gateway.upstream": upstream})
            for upstream, value in values.items()
        ]


def _resolved(provider: metrics.MeterProvider) -> object:
    """The provider whose meters instruments made on `provider` end up on: the installed
    SDK's for the OTel API's global proxy once one is installed, else `provider`."""
    real = getattr(provider, "_real_meter_provider", None)
    return provider if real is None else real
