"""The `fallback-mw request` trace as a table for people (`--json` prints the object).

Every cell comes from the trace object (`one_request.trace_of`); this module only lays it
out. Text that reaches a terminal is made printable first (an upstream body shown with
`--show-body` could hold escape sequences)."""

from __future__ import annotations

from typing import Any

from fallback_mw.quoting import printable as shown

_COLUMNS = ("#", "candidate", "step", "status", "kind", "who", "ms", "left ms", "next")


def printable(text: str) -> str:
    """`text` as quoting.printable shows it, line breaks and tabs kept (a body's lines)."""
    return "\n".join("\t".join(map(shown, line.split("\t"))) for line in text.split("\n"))


def _cell(value: object) -> str:
    if value is None or value == "":
        return "-"
    return printable(str(value)).replace("\n", " ")


def _row(step: dict[str, Any]) -> tuple[str, ...]:
    if step["step"] == "skip":
        return ("-", step["candidate"], "skipped", "-", "-", "-", "-", "-", step["reason"])
    kind = step["failure_kind"]
    if kind == "timeout" and step.get("timer"):
        kind = f"timeout ({step['timer']})"  # connect_timeout_ms or first_byte_timeout_ms
    if step["fault"]:
        kind = f"{step['fault']} fault" if kind == "fault" else f"{kind} ({step['fault']} fault)"
    name = step["candidate"]
    if step["credential_index"] is not None and step["pool_size"] > 1:
        name = f"{name} [credential {step['credential_index']}]"
    if step["hedge"]:
        name = f"{name} (hedge)"
    decision = step["decision"]
    action = f"{decision}: {step['reason']}" if decision and step["reason"] else decision
    return (
        str(step["number"]),
        name,
        "attempt",
        _cell(step["status"]),
        _cell(kind),
        _cell(step["responsible"]),
        _cell(step["elapsed_ms"]),
        _cell(step["deadline_left_ms"]),
        _cell(action),
    )


def _grid(rows: list[tuple[str, ...]]) -> list[str]:
    header = _COLUMNS
    widths = [max(len(_cell(r[i])) for r in [header, *rows]) for i in range(len(header) - 1)]
    lines = []
    for row in [header, *rows]:
        cells = [_cell(c).ljust(w) for c, w in zip(row, widths, strict=False)]
        lines.append("  " + "  ".join([*cells, _cell(row[-1])]).rstrip())
    return lines


def render(trace: dict[str, Any]) -> str:
    method, path = trace["method"], _cell(trace["path"])
    client = trace["client"]
    lines = []
    if not trace["matched"]:
        lines.append(f"request   {method} {path}: no route matches; the host app answered")
    else:
        lines.append(
            f"request   {method} {path}  route {_cell(trace['route'])}  "
            f"tenant {_cell(trace['tenant'])}  deadline {trace['deadline_ms']:.0f} ms"
        )
        plan = " -> ".join(_cell(c) for c in trace["candidates"])
        notes = [f"{trace['strategy']}", _at_most(trace["attempt_ceiling"])]
        if trace["canary"]:
            notes.append("canary: second candidate first")
        if trace["pinned"]:
            notes.append(f"pinned to {_cell(trace['pinned'])} (fault)")
        lines.append(f"plan      {plan}  ({', '.join(notes)})")
    state = trace.get("state") or {}
    if state.get("kind") == "local":
        lines.append(
            f"state     {_cell(state['url'])} unreachable ({_cell(state['reason'])}): this "
            "trace used this process's own fresh breakers, credential health and counts, "
            "not the shared ones"
        )
    headers = ", ".join(_cell(h) for h in trace["request_headers"])
    sent = f"headers {headers} (values not shown)" if headers else "no headers"
    size = trace["request_body_bytes"]
    lines.append(f"sent      {sent}; " + ("no body" if size is None else f"body {size} bytes"))
    if trace["matched"]:
        lines.append("")
        rows = [_row(step) for step in trace["steps"]]
        lines.extend(_grid(rows) if rows else ["  (no candidate was attempted or skipped)"])
        lines.append("")
        served = "nobody" if trace["chosen"] is None else _cell(trace["chosen"])
        if trace["chosen"] is not None and trace["fallback"]:
            served += " (fallback)"
        lines.append(
            f"served by {served}  attempts {trace['attempts']}  skipped {trace['skipped']}  "
            f"outcome {_cell(trace['outcome'])}"
            + (f" (rule {_cell(trace['rule'])})" if trace.get("rule") else "")
        )
        left = trace["deadline_left_ms"]
        if left is not None:
            total = trace["deadline_ms"]
            lines.append(f"deadline  {left:.1f} ms of {total:.0f} ms left at the response head")
    status = _cell(client["status"])
    code = f" {client['error_code']} (local error)" if client["error_code"] else ""
    incomplete = "" if client["complete"] else " (response aborted: incomplete)"
    lines.append(f"client    {status}{code}{incomplete}")
    for name, value in client["headers"].items():
        lines.append(f"          {_cell(name)}: {_cell(value)}")
    if "body" in client:
        lines.append(f"body      {client['body_bytes']} bytes:")
        lines.append(printable(client["body"]))
    else:
        lines.append(f"body      {client['body_bytes']} bytes (not shown; --show-body shows it)")
    return "\n".join(lines)


def _at_most(ceiling: int) -> str:
    return f"at most {ceiling} attempt{'' if ceiling == 1 else 's'}"
