"""Negative controls as code: each named mutation removes one guard from a temporary copy
of `src/`, and the tests named beside it must turn red. Bounded: only the named tests run
per mutant (about two minutes in all on a 2-core machine).

    .venv/bin/python scripts/mutants.py [--list] [--only NAME ...] [--json] [-v]

Each mutation is a textual find/replace that must find its text exactly once (a refactor
that moves the guarded line makes the script fail, so the control is rewritten rather
than silently lost). The copy is imported instead of the editable install through
PYTHONPATH; the script checks that the mutant is the module really imported before it
trusts a green run. The named tests also run once on an unmutated copy, beside the first
mutants: they must pass before any mutant is reported (a "killed" mutant means nothing if
the tests fail anyway).

Expectations: `killed` (the named tests fail on the mutant) for every guard, and
`survives` for each half of a two-guard pair run against the design's negative controls:
either guard alone stops a replay, so removing one keeps the controls green (the script
reports that as PASS), and removing both must turn them red. Exit 0 when every mutant
behaves as expected, 1 otherwise (the report says which), 2 when the script cannot run.
docs/failover.md lists each control and what it guards.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src" / "fallback_mw"

WALKER = "tests/test_walker.py::"
ASKS = "tests/test_defence_in_depth.py::"
POOL = "tests/test_credential_pool.py::"
HEDGE = "tests/test_hedge_rules.py::"
SECRET_EDGES = "tests/test_telemetry_secret_edges.py::"
POOLED = "tests/test_pool_returned.py::test_no_connection_is_left_checked_out_after_any_outcome"
INSTANCES = "tests/test_layer_instances.py::"

# The design's negative controls for what cannot be repeated (SPEC §5).
CONTROLS = (
    WALKER + "test_post_503_is_not_failed_over",
    WALKER + "test_body_over_replay_buffer_in_one_message_is_not_failed_over",
    WALKER + "test_unknown_length_body_over_replay_buffer_is_not_failed_over",
    ASKS + "test_a_streamed_body_is_not_replayed_after_it_was_consumed",
    WALKER + "test_failure_after_commit_aborts_and_never_fails_over",
)

# The two guards of SPEC §12 ("defence in depth"), as text the mutations remove.
CEILING_FIND = """    if not replayable:
        return 1
    return route.attempt_ceiling"""
CEILING_REPLACE = "    return route.attempt_ceiling"
ELIGIBILITY_FIND = """        state.replayable
        and state.client_connected"""
ELIGIBILITY_REPLACE = "        state.client_connected"
DECIDE = "failover/decide.py"
AIOHTTP_PATH = "tests/test_aiohttp_request_path.py::"
REPLAY = "failover/replay.py"
OUTCOME = "failover/outcome.py"


@dataclass(frozen=True, slots=True)
class Mutant:
    name: str
    guards: str  # what the guard protects (the docs list the same words)
    edits: tuple[tuple[str, str, str], ...]  # (file under src/fallback_mw, find, replace)
    tests: tuple[str, ...]
    expect: Literal["killed", "survives"] = "killed"


MUTANTS: tuple[Mutant, ...] = (
    # --- the four design controls -----------------------------------------------------
    Mutant(
        "consumed_body_replayed",
        "a body streamed to one attempt (not buffered) is never sent again",
        ((REPLAY, "    if not buffered:\n        return False\n", ""),),
        CONTROLS[1:4],
    ),
    Mutant(
        "post_after_503",
        "a method outside replayable_methods (POST) is never failed over",
        (
            (
                REPLAY,
                "    if method in route.replayable_methods:\n        return True",
                "    if True:\n        return True",
            ),
        ),
        (CONTROLS[0],),
    ),
    Mutant(
        "unbuffered_body",
        "a body over replay_buffer is read whole and sent once, never buffered for a replay",
        (("request/body.py", "if size <= settings.replay_buffer:", "if True:"),),
        CONTROLS[1:3],
    ),
    Mutant(
        "failure_after_commit",
        "a failure after the commit point aborts the client response, never ends it as whole",
        (
            (
                "layers/walker/stream.py",
                "return relay_outcome(exc.kind)  # never ended as if complete",
                "pass",
            ),
        ),
        (CONTROLS[4],),
    ),
    # --- the two guards: either alone holds, both removed the controls turn red ---------
    Mutant(
        "ceiling_guard_alone_removed",
        "the attempt ceiling of 1 for a request that cannot be repeated (the first guard)",
        ((REPLAY, CEILING_FIND, CEILING_REPLACE),),
        CONTROLS,
        expect="survives",
    ),
    Mutant(
        "eligibility_guard_alone_removed",
        "the eligibility check in further_attempt_possible (the second guard)",
        ((DECIDE, ELIGIBILITY_FIND, ELIGIBILITY_REPLACE),),
        CONTROLS,
        expect="survives",
    ),
    Mutant(
        "both_guards_removed",
        "what cannot be repeated: with neither guard the controls must fail",
        ((REPLAY, CEILING_FIND, CEILING_REPLACE), (DECIDE, ELIGIBILITY_FIND, ELIGIBILITY_REPLACE)),
        CONTROLS,
    ),
    Mutant(
        "ceiling_guard_unit",
        "the first guard on its own: attempt_ceiling is 1 for a request that cannot be repeated",
        ((REPLAY, CEILING_FIND, CEILING_REPLACE),),
        (ASKS + "test_the_ceiling_guard_alone_stops_a_replay",),
    ),
    Mutant(
        "eligibility_guard_unit",
        "the second guard on its own: a ceiling left at 1 + retries still stops a replay",
        ((DECIDE, ELIGIBILITY_FIND, ELIGIBILITY_REPLACE),),
        (ASKS + "test_the_eligibility_guard_alone_stops_a_replay",),
    ),
    # --- the asks ----------------------------------------------------------------------
    Mutant(
        "runtime_credential_skip_removed",
        "a candidate whose credential is unset at run time is skipped, never sent bare",
        (
            (
                "layers/walker/cursor.py",
                "if credential_index is None or not self.has_credential(name, credential_index):"
                "\n                    # A pool a fault emptied",
                "if credential_index is None:\n                    # A pool a fault emptied",
            ),
        ),
        (
            ASKS + "test_a_backup_without_its_credential_is_skipped_never_sent_bare",
            ASKS + "test_a_primary_without_its_credential_is_skipped_and_costs_no_attempt",
        ),
    ),
    Mutant(
        "hedge_credential_skip_removed",
        "a hedge whose pool credential is unset at run time is not started, never sent bare",
        (
            (
                "layers/walker/cursor.py",
                "if credential_index is None or not self.has_credential(name, credential_index):"
                "\n                return None",
                "if credential_index is None:\n                return None",
            ),
        ),
        (ASKS + "test_a_hedge_never_goes_out_without_its_credential",),
    ),
    Mutant(
        "backoff_between_candidates",
        "no backoff before a different candidate; backoff_ms only before a repeat",
        (
            (
                "layers/walker/walk.py",
                "if pick.repeat and self.route.backoff_ms:",
                "if self.route.backoff_ms and context.attempt_count:",
            ),
        ),
        (ASKS + "test_no_backoff_between_different_candidates",),
    ),
    Mutant(
        "backoff_never",
        "backoff_ms before repeating a candidate already tried",
        (("layers/walker/walk.py", "if pick.repeat and self.route.backoff_ms:", "if False:"),),
        (ASKS + "test_backoff_only_before_repeating_a_candidate",),
    ),
    Mutant(
        "commit_point",
        "nothing reaches the client before a response is accepted (the commit point)",
        (
            (
                "layers/walker/stream.py",
                "if declared is not None and declared > limit:",
                "if False:",
            ),
        ),
        (WALKER + "test_response_over_ceiling_is_502_before_commit",),
    ),
    Mutant(
        "rand_shuffles_the_primary",
        'strategy = "random" keeps the plan\'s first candidate first',
        (
            (
                "plan.py",
                "        fallbacks = order[1:]\n        (rng or random).shuffle(fallbacks)\n"
                "        order[1:] = fallbacks\n",
                "        (rng or random).shuffle(order)\n",
            ),
        ),
        ("tests/test_plans.py::test_random_keeps_the_first_candidate_first_and_draws_the_rest",),
    ),
    Mutant(
        "affinity_by_session_alone",
        "session affinity keyed by (route, model, session), not the session alone",
        (
            (
                "layers/walker/walk.py",
                "affinity_key(self.route.id, context.request_model, context.session),",
                "context.session,",
            ),
        ),
        (POOL + "test_affinity_is_keyed_by_route_model_and_session",),
    ),
    Mutant(
        "score_selection_ignored",
        'selection = "score" orders the pool by recent success and latency',
        (("health/pool.py", 'if selection != "score":', "if True:"),),
        (POOL + "test_score_selection_prefers_the_fast_credential",),
    ),
    Mutant(
        "quota_429_as_rate_limit",
        "a 429 that says the quota is spent retires the credential until its reset",
        (("health/pool.py", "if status == 429 and quota is not None:", "if False:"),),
        (POOL + "test_a_spent_quota_retires_until_its_reset_a_rate_limit_cools_down",),
    ),
    Mutant(
        "peeked_429_bytes_lost",
        "the bytes read to judge a 429 still reach the client",
        (
            (
                "health/quota.py",
                "        if prefix:\n            yield prefix",
                "        if 0:\n            yield prefix",
            ),
        ),
        (POOL + "test_a_429_body_is_relayed_whole_after_the_peek",),
    ),
    Mutant(
        "incidents_miss_failovers",
        "usage --incidents lists a request that failed over, with its trail",
        (
            (
                "cli/usage.py",
                "if sum(1 for a in record.attempts if a.skipped is None) > 1:",
                "if sum(1 for a in record.attempts if a.skipped is None) > 2:",
            ),
        ),
        (POOL + "test_usage_incidents_lists_failed_over_and_local_errors_with_their_trails",),
    ),
    Mutant(
        "fallback_path_differs",
        "every candidate gets the same (normalised) path and query",
        (
            (
                "failover/send.py",
                "return upstream.url + target\n",
                'return upstream.url + (target if self.context.attempt_count == 1 else "/")\n',
            ),
        ),
        (ASKS + "test_every_candidate_gets_the_same_path_and_query",),
    ),
    Mutant(
        "forged_gateway_headers_kept",
        "a caller's x-gateway-* header never reaches an upstream or changes the walk",
        (
            (
                "security/fields.py",
                "            or canonical.startswith(GATEWAY_HEADER_PREFIX)\n",
                "",
            ),
            (  # the one pass a head without Connection / Trailer takes
                "security/fields.py",
                "            or canonical.startswith(GATEWAY_HEADER_PREFIX)"
                "  # a caller's x-gateway-*\n",
                "",
            ),
        ),
        (ASKS + "test_forged_gateway_headers_change_nothing",),
    ),
    Mutant(
        "caller_deadline_lengthens",
        "x-gateway-deadline-ms may shorten the route deadline, never lengthen it",
        (
            (
                "routing.py",
                "deadline_ms = min(deadline_ms, requested_ms)",
                "deadline_ms = requested_ms",
            ),
        ),
        (ASKS + "test_a_forged_deadline_cannot_lengthen_the_walk",),
    ),
    Mutant(
        "shared_first_byte_timeout",
        "each candidate its own connect / first-byte timeout",
        (
            (
                "failover/send.py",
                "timeouts, _, slots, shadow_slots = _derived(upstream)\n",
                "timeouts, _, slots, shadow_slots = _derived(upstream)\n"
                "        first = _derived(context.upstreams[context.candidates[0]])[0]\n"
                "        timeouts = Timeouts(timeouts.connect, first.first_byte, timeouts.idle)\n",
            ),
        ),
        (ASKS + "test_each_candidate_gets_its_own_first_byte_timeout",),
    ),
    Mutant(
        "shared_connect_timeout",
        "each candidate its own connect timeout",
        (
            (
                "failover/send.py",
                "timeouts, _, slots, shadow_slots = _derived(upstream)\n",
                "timeouts, _, slots, shadow_slots = _derived(upstream)\n"
                "        last = _derived(context.upstreams[context.candidates[-1]])[0]\n"
                "        timeouts = Timeouts(last.connect, timeouts.first_byte, timeouts.idle)\n",
            ),
        ),
        (ASKS + "test_each_candidate_gets_its_own_connect_timeout",),
    ),
    Mutant(
        "replay_drops_model_rewrite",
        "a replay keeps the candidate's model rewrite",
        (
            (
                "failover/send.py",
                "if upstream.model and self.parsed is not None and not self.rendered:",
                "if upstream.model and self.parsed is not None and not self.rendered"
                " and self.context.attempt_count == 1:",
            ),
        ),
        (ASKS + "test_a_replay_keeps_each_candidates_model_and_a_consistent_length",),
    ),
    Mutant(
        "caller_content_length_forwarded",
        "the Content-Length sent is the rewritten body's, never the caller's",
        (
            (
                "security/fields.py",
                'RECOMPUTED_HEADERS: Final = frozenset({b"host", b"content-length", b"expect"})',
                'RECOMPUTED_HEADERS: Final = frozenset({b"host", b"expect"})',
            ),
        ),
        (ASKS + "test_a_replay_keeps_each_candidates_model_and_a_consistent_length",),
    ),
    Mutant(
        "streamed_body_length_unchecked",
        "a streamed body is held to the Content-Length it goes out with",
        (
            (
                "request/body.py",
                "        if size > declared:  # declared <= limit",
                "        if size > limit:  # declared <= limit",
            ),
            (
                "request/body.py",
                "                if size < declared:\n                    body.misframed = True",
                "                if False:\n                    body.misframed = True",
            ),
        ),
        tuple(
            "tests/hostile/test_request_framing.py::"
            f"test_a_streamed_body_that_is_not_its_declared_length_is_the_callers_400[{case}]"
            for case in ("short-aiohttp", "crossing-httpx")
        ),
    ),
    # --- game days and the evaluation (issue 18) -----------------------------------------
    Mutant(
        "eval_breaker_left_at_defaults",
        "eval holds breakers closed, so the plan is what it measures",
        (
            (
                "cli/evaluation/arms.py",
                '    if not breaker:\n        gateway["breaker"] = HELD_CLOSED\n',
                "",
            ),
        ),
        ("tests/e2e/test_eval.py::test_eval_failing_primary_measures_the_plan",),
    ),
    Mutant(
        "faults_set_overwrites_an_active_fault",
        "faults set refuses while a fault holds the same target (SQLite)",
        (("store/sqlite.py", "if active is not None and not replace:", "if False:"),),
        (
            "tests/test_faults.py::"
            "test_faults_set_refuses_an_active_fault_on_the_same_target_unless_replace[sqlite]",
        ),
    ),
    Mutant(
        "blackhole_through_the_guarded_client",
        "the blackhole listener is reached by its own client, exempt from allow_hosts",
        (
            (
                "failover/send.py",
                "base, client = await self.faults.blackhole().open()",
                "base, _ = await self.faults.blackhole().open()",
            ),
        ),
        (
            "tests/test_faults.py::"
            "test_blackhole_connects_to_a_silent_listener_and_the_engines_timeout_fires",
        ),
    ),
    # --- the metadata guard (SPEC §3: refused whatever the allowlist) ---------------------
    Mutant(
        "cloud_metadata_address_allowed",
        "a cloud metadata address outside 169.254.0.0/16 is refused whatever the allowlist",
        (("security/addresses.py", '    ipaddress.ip_network("168.63.129.16/32"),\n', ""),),
        (
            "tests/hostile/test_cloud_metadata.py::"
            "test_a_cloud_metadata_upstream_or_proxy_is_refused_at_load_whatever_the_allowlist",
        ),
    ),
    Mutant(
        "no_allowlist_no_metadata_guard",
        "a client made without an allowlist still refuses link-local / metadata addresses",
        (
            (
                "security/addresses.py",
                "            if not is_always_refused("
                'ipaddress.ip_address(text.split("%", 1)[0]))\n',
                "",
            ),
        ),
        (
            "tests/hostile/test_cloud_metadata.py::"
            "test_no_allowlist_keeps_every_address_but_the_always_refused",
        ),
    ),
    Mutant(
        "httpx_proxied_literal_unchecked",
        "an upstream IP literal behind an egress proxy is checked at connect time (httpx)",
        (
            (
                "upstream/httpx_engine.py",
                "                self._literals.check(request.url)\n",
                "                pass\n",
            ),
        ),
        (
            "tests/hostile/test_egress_proxy.py::"
            "test_a_metadata_literal_behind_a_proxy_is_refused_at_connect_time",
        ),
    ),
    Mutant(
        "unmaskable_answer_relayed",
        "an answer the echo mask cannot read never reaches the caller from an upstream that "
        "holds the gateway's credential",
        (
            (
                "credentials.py",
                "    return named\n",
                "    return None\n",
            ),
        ),
        (
            "tests/hostile/test_credential_echo.py::"
            "test_an_answer_the_mask_cannot_read_is_never_relayed_from_an_upstream_holding_a_key",
            "tests/hostile/test_credential_echo.py::"
            "test_a_range_or_a_stream_the_mask_cannot_read_is_never_relayed_with_its_key",
        ),
    ),
    # --- found by hand-made mutants no test killed (docs/failover.md) -------------------
    Mutant(
        "hedge_429_outside_a_pool",
        "outside a credential pool a 429 wins a hedge race and is served as-is",
        (
            (
                OUTCOME,
                'return pooled and outcome.kind == "status" and outcome.status in',
                'return outcome.kind == "status" and outcome.status in',
            ),
        ),
        (HEDGE + "test_a_429_without_a_pool_wins_the_race_and_is_served_as_is",),
    ),
    Mutant(
        "hedge_at_a_fallback",
        "only the plan's first candidate is hedged, never a fallback whose primary was skipped",
        ((REPLAY, "        and at_first_candidate\n", ""),),
        (HEDGE + "test_no_hedge_at_the_fallback_when_the_primary_is_skipped",),
    ),
    Mutant(
        "probe_slot_kept_after_a_local_outcome",
        "a half-open probe a local outcome ended (the caller's deadline) frees its slot",
        (
            (
                "failover/attempt.py",
                "if mark is None:\n            now.release_now(name, admission)\n"
                "            return\n",
                "if mark is None:\n            return\n",
            ),
            (
                "failover/attempt.py",
                "elif mark is None:\n            await self.health.release(name, admission)\n",
                "elif mark is None:\n            pass\n",
            ),
        ),
        ("tests/test_probe_slots.py::test_a_probe_the_callers_deadline_ended_frees_its_slot",),
    ),
    Mutant(
        "pool_key_reused_through_affinity",
        "a request uses each pool credential at most once, its session's bound one too",
        (
            (
                "health/pool.py",
                "usable = bound is not None and bound < pool_size and bound not in exclude",
                "usable = bound is not None and bound < pool_size",
            ),
        ),
        (
            "tests/test_pool_rules.py::"
            "test_a_session_bound_key_used_once_is_not_used_again_in_the_same_request[memory]",
        ),
    ),
    Mutant(
        "settlement_unshielded",
        "a request an anyio host cancels still settles its hold (one settlement)",
        (
            (
                "layers/guard.py",
                "if self._shield:\n            with anyio.CancelScope(shield=True):",
                "if False:\n            with anyio.CancelScope(shield=True):",
            ),
        ),
        (
            "tests/test_settle_cancelled.py::"
            "test_a_request_an_anyio_host_cancels_mid_stream_still_settles_its_hold[own]",
        ),
    ),
    Mutant(
        "streamed_answer_one_byte_over",
        "a streamed answer one byte over max_response_body is aborted, never relayed whole",
        (
            (
                "layers/walker/stream.py",
                "                    if received > limit or coded > limit:",
                "                    if received > limit + 1 or coded > limit + 1:",
            ),
        ),
        (
            "tests/test_response_limit_edges.py::"
            "test_a_body_of_the_limit_is_served_one_byte_more_is_not[1025-streamed]",
        ),
    ),
    Mutant(
        "encoded_climb_spelled",
        "a caller's escaped separator is kept only where no dot segment could climb with it",
        (
            (
                "spelling.py",
                '            if any(piece.split(";", 1)[0] in (".", "..") for piece in pieces):\n'
                "                return None\n",
                "",
            ),
        ),
        (WALKER + "test_the_callers_percent_encoding_of_a_segment_reaches_the_upstream",),
    ),
    # --- found by the backend differentials (tests/test_backends_agree_*.py) ----------
    Mutant(
        "old_url_outcome_on_redis",
        "on the Redis state an outcome admitted before the upstream moved to another url "
        "goes to no breaker, as on the memory state",
        (
            (
                "health/redis.py",
                "        if self._moved_since(upstream, admission):\n            return\n"
                "        config = self.config\n",
                "        config = self.config\n",
            ),
        ),
        (
            "tests/test_backends_agree_health.py::"
            "test_an_outcome_of_the_old_url_does_not_open_the_new_urls_breaker_on_redis",
        ),
    ),
    Mutant(
        "stale_first_attempts_deposited_now",
        "a first attempt counted in this process reaches Redis in its own second: one older "
        "than the repeat allowance's window grants no repeat",
        (
            (
                "capacity/redis.py",
                "'f:' .. (now - tonumber(ARGV[i]))",
                "'f:' .. now",
            ),
        ),
        (
            "tests/test_backends_agree_capacity.py::"
            "test_a_first_attempt_older_than_the_window_grants_no_repeat_on_redis",
        ),
    ),
    Mutant(
        "memory_usage_limit_0_is_all",
        "the memory ledger's newest 0 usage records are none, as the SQL ledgers' LIMIT 0",
        (
            (
                "store/ledgers/memory.py",
                "return found[-limit:] if limit > 0 else []",
                "return found[-limit:]",
            ),
        ),
        (
            "tests/test_backends_agree_ledger.py::"
            "test_the_newest_0_records_are_none_on_every_ledger",
        ),
    ),
    # --- found by hand-made mutants outside the decision core (docs/failover.md) ---------
    Mutant(
        "secret_of_min_length_not_searched",
        "a caller credential of exactly MIN_SECRET (8) characters is never recorded",
        (
            (
                "request/secrets.py",
                "    return [form for form in forms if len(form) >= MIN_SECRET]",
                "    return [form for form in forms if len(form) > MIN_SECRET]",
            ),
        ),
        (
            SECRET_EDGES + "test_a_credential_of_exactly_min_secret_characters_is_known_one_"
            "shorter_is_not[Zq8wL2pX-True]",
        ),
    ),
    Mutant(
        "percent_encoded_query_key_not_known",
        "a caller's key sent percent-encoded in a stripped query parameter is a credential",
        (
            (
                "request/secrets.py",
                "                        found.extend(secret_forms(unquote_to_bytes("
                'value.replace(b"+", b" "))))\n',
                "",
            ),
        ),
        (
            SECRET_EDGES + "test_a_callers_key_in_the_query_in_any_spelling_is_known_as_a_"
            "credential[api_key=sk%2Dcaller%2DAb4Cd6Ef8Gh]",
        ),
    ),
    Mutant(
        "credential_past_the_recorded_part",
        "a credential that begins in a value's recorded part and runs past it is found",
        (
            (
                "request/secrets.py",
                "secret, 0, end + len(secret) - 1",
                "secret, 0, end",
            ),
        ),
        (
            SECRET_EDGES
            + "test_a_credential_that_begins_in_the_recorded_part_and_runs_past_it_is_known",
        ),
    ),
    Mutant(
        "override_counts_the_request_method",
        "a _method naming the request's own method is no override (a keyed POST replays)",
        (
            (
                "security/queries.py",
                "    named.discard(method)\n    return frozenset(named) if named else NO_METHODS",
                "    return frozenset(named) if named else NO_METHODS",
            ),
        ),
        (
            "tests/test_idempotency_key.py::"
            "test_an_override_that_names_the_post_itself_keeps_it_replayable[query]",
        ),
    ),
    Mutant(
        "method_parameter_filter_misses_escapes",
        "a _method parameter spelled with escapes only (_m%65thod) is still read",
        (("security/queries.py", " and PERCENT not in query)", ")"),),
        (
            "tests/hostile/test_method_override.py::test_a_method_query_parameter_to_a_method_"
            "the_route_does_not_forward_is_405[encoded-letter]",
        ),
    ),
    Mutant(
        "capital_scheme_url_keeps_its_key",
        "a URL in a field (Referer, X-Original-URI) loses its credential query keys "
        "whatever its scheme's case",
        (
            (
                "security/queries.py",
                "head[:8].lower().startswith(_URL_SCHEMES)",
                "head[:8].startswith(_URL_SCHEMES)",
            ),
        ),
        (
            "tests/hostile/test_operator_input.py::"
            "test_a_url_in_a_request_header_loses_the_credential_query_keys_too",
        ),
    ),
    Mutant(
        "this_network_address_allowed",
        "0.0.0.0/8 (a connect reaches the host's own services) is refused whatever the allowlist",
        (
            (
                "security/addresses.py",
                '    ipaddress.ip_network("0.0.0.0/8"),  # "this network": connects to local '
                "services\n",
                "",
            ),
        ),
        (
            "tests/hostile/test_decided_risks.py::test_metadata_and_translation_ranges_are_"
            "refused_under_the_widest_allowlist[0.0.0.0]",
        ),
    ),
    Mutant(
        "bodiless_answer_refused_as_unmaskable",
        "a HEAD's answer (no body) labelled br is relayed from an upstream holding a key",
        (
            (
                "credentials.py",
                'if context.method == "HEAD" or status in',
                "if status in",
            ),
        ),
        (
            "tests/hostile/test_unmaskable_bodiless.py::"
            "test_a_bodiless_answer_in_a_coding_the_mask_cannot_read_is_relayed[HEAD-200-aiohttp]",
        ),
    ),
    # --- STYLE.md's design rules (docs/failover.md: the controls after the table's last) ---
    Mutant(
        "redirect_followed_aiohttp",
        "an upstream's redirect is relayed to the caller, never followed (aiohttp engine)",
        # On ClientSession.request, the path under another aiohttp release (the engine's
        # own path, upstream/aiohttp_request.py request, has no redirect to follow).
        (
            ("upstream/aiohttp_request.py", "allow_redirects=False,", "allow_redirects=True,"),
            (
                "upstream/aiohttp_request.py",
                '_ON: dict[str, bool] = {"path": aiohttp.__version__.startswith(_READ_AGAINST)}',
                '_ON: dict[str, bool] = {"path": False}',
            ),
        ),
        (WALKER + "test_redirects_are_never_followed",),
    ),
    Mutant(
        "redirect_followed_httpx",
        "an upstream's redirect is relayed to the caller, never followed (httpx engine)",
        (
            (
                "upstream/httpx_engine.py",
                "stream=True, follow_redirects=False)",
                "stream=True, follow_redirects=True)",
            ),
        ),
        (WALKER + "test_redirects_are_never_followed",),
    ),
    Mutant(
        "relay_buffered",
        "a streamed answer is relayed chunk by chunk, never collected first",
        (
            (
                "layers/walker/stream.py",
                "                async for chunk in chunks:\n",
                '                whole = b"".join([piece async for piece in chunks])\n'
                "                for chunk in [whole]:\n",
            ),
        ),
        (
            "tests/test_relay_unbuffered.py::"
            "test_the_first_chunk_reaches_the_client_before_the_upstream_sends_the_second"
            "[text/event-stream-aiohttp]",
        ),
    ),
    Mutant(
        "upload_read_whole",
        "an upload past replay_buffer with its length streams to the upstream as it arrives",
        (
            (
                "request/body.py",
                "    head_limit = settings.replay_buffer if declared is not None else limit\n",
                "    head_limit = limit\n",
            ),
        ),
        (
            "tests/test_relay_unbuffered.py::"
            "test_an_upload_past_replay_buffer_reaches_the_upstream_before_the_caller_sends_the_rest"
            "[aiohttp]",
        ),
    ),
    Mutant(
        "unread_answer_connection_kept",
        "an answer closed unread gives its connection back (closed), never left acquired",
        (
            (
                "upstream/aiohttp_engine.py",
                "            # An unread body: the connection cannot be reused safely.\n"
                "            self._response.close()\n",
                "            pass\n",
            ),
        ),
        (POOLED + "[aiohttp]",),
    ),
    Mutant(
        "httpx_answer_never_closed",
        "the httpx engine closes every answer it hands out (its connection back to the pool)",
        (("upstream/httpx_response.py", "        await asyncio.shield(self._close())\n", ""),),
        (POOLED + "[httpx]",),
    ),
    Mutant(
        "layer_keeps_the_tenant",
        "nothing of a request is kept on a shared layer instance",
        (
            (
                "layers/injector.py",
                "        if isinstance(context, RequestContext):\n",
                "        if isinstance(context, RequestContext):\n"
                "            self.tenant = context.tenant\n",
            ),
        ),
        (INSTANCES + "test_no_layer_keeps_anything_of_a_request_on_itself",),
    ),
    Mutant(
        "configuration_parsed_per_request",
        "the configuration is parsed and validated once, when a layer is built",
        (
            (
                "layers/injector.py",
                "        context = scope.get(SCOPE_KEY)",
                '        as_config({"upstreams": {}, "routes": []})\n'
                "        context = scope.get(SCOPE_KEY)",
            ),
        ),
        (INSTANCES + "test_no_configuration_is_parsed_or_validated_while_serving",),
    ),
    Mutant(
        "unrouted_request_stripped",
        "a request no route matches reaches the host app untouched (its credentials are its own)",
        (
            (
                "layers/resolver.py",
                "        raw_path = raw_routed_path(scope)\n",
                '        scope["headers"] = [f for f in headers if f[0] != b"authorization"]\n'
                "        raw_path = raw_routed_path(scope)\n",
            ),
        ),
        (
            "tests/test_unrouted_untouched.py::"
            "test_a_request_no_route_matches_reaches_the_host_app_untouched",
        ),
    ),
    Mutant(
        "own_path_drops_the_query",
        "the aiohttp engine's own path sends the target byte for byte (its query too)",
        (
            (
                "upstream/aiohttp_request.py",
                "{self.url.raw_path_qs} HTTP/",
                "{self.url.raw_path} HTTP/",
            ),
        ),
        (AIOHTTP_PATH + "test_the_target_goes_out_byte_for_byte_with_its_query",),
    ),
    Mutant(
        "lean_request_drops_the_query",
        "the aiohttp engine's lean request sends the target byte for byte (its query too)",
        (("upstream/aiohttp_lean.py", "{url.raw_path_qs} HTTP/", "{url.raw_path} HTTP/"),),
        (AIOHTTP_PATH + "test_the_target_goes_out_byte_for_byte_with_its_query",),
    ),
    Mutant(
        "lean_request_left_unused",
        "the usual attempt goes out without aiohttp's ClientRequest, on one kept-alive connection",
        (
            (
                "upstream/aiohttp_engine.py",
                "target = lean_target(self._targets, url, ssl)",
                "target = None",
            ),
        ),
        (AIOHTTP_PATH + "test_the_usual_attempt_goes_out_lean_on_one_kept_alive_connection",),
    ),
    Mutant(
        "lean_pool_never_taken",
        "a kept-alive connection is taken from the pool without the connector's connect",
        (
            (
                "upstream/aiohttp_lean.py",
                "    if connector._closed or connector._limit_per_host:\n        return None",
                "    return None",
            ),
        ),
        (AIOHTTP_PATH + "test_a_kept_alive_connection_is_taken_from_the_pool_without_connect",),
    ),
    Mutant(
        "lean_pool_timer_unarmed",
        "a kept-alive connection taken from the pool still runs the first-byte timer",
        (("upstream/aiohttp_lean.py", "        sending.timer.arm()\n", ""),),
        (AIOHTTP_PATH + "test_a_kept_alive_connection_is_taken_from_the_pool_without_connect",),
    ),
    Mutant(
        "lean_pool_waiters_ignored",
        "a connection given back wakes an attempt waiting for a slot",
        (("upstream/aiohttp_lean.py", "        or connector._waiters\n", ""),),
        (AIOHTTP_PATH + "test_a_connection_given_back_wakes_an_attempt_waiting_for_a_slot",),
    ),
    Mutant(
        "lean_pool_keepalive_ignored",
        "a pooled connection past its keep-alive is not taken",
        (
            (
                "upstream/aiohttp_lean.py",
                "        or (keepalive is not None and monotonic() - since > keepalive)\n",
                "",
            ),
        ),
        (AIOHTTP_PATH + "test_a_kept_alive_connection_past_its_keepalive_is_not_taken",),
    ),
    Mutant(
        "memory_calls_left_unused",
        "the memory state's per-attempt calls are made compiled, without its methods",
        (
            (
                "failover/attempt.py",
                "self._memory = type(health) is MemoryHealth",
                "self._memory = False",
            ),
        ),
        (
            "tests/test_immediate_states.py::"
            "test_the_memory_states_per_attempt_calls_are_made_without_its_methods",
        ),
    ),
    Mutant(
        "own_path_writer_task",
        "a small buffered body goes out with its head, without aiohttp's writer task",
        (
            (
                "upstream/aiohttp_lean.py",
                "ONE_WRITE_MAX: Final = 16 * 1024",
                "ONE_WRITE_MAX: Final = 0",
            ),
        ),
        (AIOHTTP_PATH + "test_a_small_buffered_body_goes_out_without_a_writer_task",),
    ),
)


class CannotRun(Exception):
    """The script cannot do its job (a find text gone, the copy not imported, ...)."""


def make_copy(workdir: Path, edits: tuple[tuple[str, str, str], ...]) -> Path:
    """A fresh copy of src/fallback_mw under `workdir`/src with `edits` applied; returns
    the directory to put on PYTHONPATH."""
    src = workdir / "src"
    if src.exists():
        shutil.rmtree(src)
    shutil.copytree(
        SRC, src / "fallback_mw", ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.pyd")
    )
    for relative, find, replace in edits:
        path = src / "fallback_mw" / relative
        text = path.read_text()
        found = text.count(find)
        if found != 1:
            raise CannotRun(
                f"{relative}: the text to mutate is found {found} times (expected once): "
                f"{find.strip()[:70]!r}"
            )
        path.write_text(text.replace(find, replace))
    return src


def environment(src: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(src), str(ROOT)])
    env["PYTHONDONTWRITEBYTECODE"] = "1"  # nothing of a mutant is left behind
    return env


def check_imported(src: Path, env: dict[str, str]) -> None:
    """The mutant package, not the editable install, is what `import fallback_mw` finds."""
    probe = subprocess.run(
        [sys.executable, "-c", "import fallback_mw; print(fallback_mw.__file__)"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    where = Path(probe.stdout.strip() or "?").resolve()
    if probe.returncode != 0 or not where.is_relative_to(src.resolve()):
        raise CannotRun(f"the copy is not what is imported (fallback_mw from {where})")


def run_tests(tests: tuple[str, ...], env: dict[str, str], src: Path) -> tuple[int, str]:
    """pytest on `tests` against the copy; (exit code, the last lines of its output)."""
    # conftest.py asserts the package comes from the copy (FMW_MUTANT_SRC), so a green run
    # can never be the editable install's.
    env = {**env, "FMW_MUTANT_SRC": str(src)}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    lines = (result.stdout + result.stderr).strip().splitlines()
    failed = [line for line in lines if line.startswith(("FAILED", "ERROR"))]
    return result.returncode, "\n".join(failed[:3] + lines[-1:])


@dataclass
class Result:
    name: str
    expect: str
    outcome: str  # "killed", "survives" or "error"
    seconds: float
    detail: str

    @property
    def ok(self) -> bool:
        return self.outcome == self.expect


def run_mutant(mutant: Mutant, workdir: Path) -> Result:
    started = time.monotonic()
    src = make_copy(workdir, mutant.edits)
    env = environment(src)
    check_imported(src, env)
    code, tail = run_tests(mutant.tests, env, src)
    # pytest: 0 all passed, 1 some failed; anything else (usage, collection, internal
    # error) says nothing about the mutant.
    outcome = {0: "survives", 1: "killed"}.get(code, "error")
    return Result(mutant.name, mutant.expect, outcome, time.monotonic() - started, tail)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run only these mutants")
    parser.add_argument("--json", action="store_true", help="one JSON report on stdout")
    parser.add_argument("-v", "--verbose", action="store_true", help="pytest's last lines too")
    parser.add_argument(
        "--jobs", type=int, default=2, help="mutants run at a time (default 2: two cores)"
    )
    args = parser.parse_args(argv)
    mutants = MUTANTS
    if args.only:
        unknown = set(args.only) - {m.name for m in MUTANTS}
        if unknown:
            print(f"unknown mutant(s): {', '.join(sorted(unknown))}", file=sys.stderr)
            return 2
        mutants = tuple(m for m in MUTANTS if m.name in args.only)
    if args.list:
        for mutant in mutants:
            print(f"{mutant.name:34} {mutant.expect:9} {mutant.guards}")
        return 0
    results: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="fmw-mutants-") as tmp:
        workdir = Path(tmp)
        try:
            # The baseline: every named test passes on an unmutated copy.
            src = make_copy(workdir, ())
            env = environment(src)
            check_imported(src, env)
            tests = tuple(dict.fromkeys(t for m in mutants for t in m.tests))
            # Each mutant in its own copy; `--jobs` at a time (each is mostly a pytest run).
            # The baseline is the first job, the mutants start beside it (it took a quarter
            # of the script's time, run alone before them); none is reported before it
            # passed, and none is waited for once it failed.
            with ThreadPoolExecutor(max_workers=args.jobs) as pool:
                baseline = pool.submit(run_tests, tests, env, src)
                futures = [
                    pool.submit(run_mutant, mutant, workdir / f"m{number}")
                    for number, mutant in enumerate(mutants)
                ]
                code, tail = baseline.result()
                if code != 0:
                    pool.shutdown(wait=True, cancel_futures=True)
                    raise CannotRun(f"the named tests fail without any mutation:\n{tail}")
                for future in futures:  # printed in the table's order, as they finish
                    result = future.result()
                    results.append(result)
                    if not args.json:
                        verdict = "PASS" if result.ok else "FAIL"
                        print(
                            f"{verdict}  {result.name:34} {result.outcome:9} "
                            f"(expected {result.expect}, {result.seconds:.1f} s)",
                            flush=True,
                        )
                        if args.verbose or not result.ok:
                            detail = result.detail.replace("\n", "\n      ")
                            print("      " + detail, flush=True)
        except CannotRun as exc:
            print(f"mutants: {exc}", file=sys.stderr)
            return 2
    failed = [r for r in results if not r.ok]
    if args.json:
        print(json.dumps([r.__dict__ | {"ok": r.ok} for r in results], indent=2))
    else:
        print(
            f"{len(results) - len(failed)}/{len(results)} mutants behaved as expected"
            + (f"; FAILED: {', '.join(r.name for r in failed)}" if failed else "")
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
