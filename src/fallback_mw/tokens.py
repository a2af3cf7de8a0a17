"""Token estimates made before a request is sent: ~4 bytes of JSON per input token, plus
the largest output limit the body names times the completions it asks for. The budget
hold prices this estimate; declared capacity (`tpm`) counts it until the upstream reports
the real usage."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Any, Final

BYTES_PER_TOKEN: Final = 4
# Token counts are believed up to this (a 10^15-token response does not exist).
MAX_TOKENS: Final = 10**15
OUTPUT_LIMIT_KEYS: Final = ("max_tokens", "max_completion_tokens", "max_output_tokens")
OUTPUT_COPIES_KEYS: Final = ("n", "best_of")
# Gemini / Vertex AI set them in `generationConfig` (`generation_config`: protobuf JSON
# takes either spelling): `maxOutputTokens`, `candidateCount`; the keys read casefolded.
GENERATION_CONFIG_KEYS: Final = ("generationconfig", "generation_config")
GENERATION_LIMIT_KEYS: Final = ("maxoutputtokens", "max_output_tokens")
GENERATION_COPIES_KEYS: Final = ("candidatecount", "candidate_count")
_COPIES_AND_PROMPT: Final = (*OUTPUT_COPIES_KEYS, "prompt")
# An integer in a string as pydantic's lax mode reads one (so vLLM's and the SDKs' models):
# a `+`, single `_` between digits, any leading zeros, a fraction of zeros.
_LAX_INTEGER: Final = re.compile(r"\+?([0-9]+(?:_[0-9]+)*)(?:\.0+)?")
_DIGITS: Final = len(str(MAX_TOKENS))


def token_count(value: Any) -> int | None:
    """A token count as a lenient reader reads it: an integer, an integral number
    (`1e8`, `100000000.0`) or a string holding an integer as pydantic's lax mode reads
    one, and so vLLM's and the SDKs' validated models (`"100000000"`, `"+100000000"`,
    `"100_000_000"`, `"100000000.0"`, leading zeros). Negative or unreadable: None. Read so for an
    output limit in a request (it limits nothing, and hides no other limit) and for the
    usage an upstream reports (request/usage.py)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return min(value, MAX_TOKENS) if value >= 0 else None
    if isinstance(value, float):
        if math.isfinite(value) and value >= 0 and value.is_integer():
            return min(int(value), MAX_TOKENS)
        return None
    if isinstance(value, str):
        match = _LAX_INTEGER.fullmatch(value.strip())
        if match is not None:
            # Leading zeros read as nothing; more digits than MAX_TOKENS has is more.
            digits = match[1].replace("_", "").lstrip("0")
            return min(int(digits or "0"), MAX_TOKENS) if len(digits) <= _DIGITS else MAX_TOKENS
    return None


def read_json(data: bytes | str) -> Any:
    """`data` as `json.loads` reads it, except that an integer of over 4,300 digits, which
    Python alone refuses (a ValueError, as for bad JSON), is read saturated, as the JSON it
    is: Go's encoding/json skips such a number in a field it does not read and Node's
    `JSON.parse` takes it as a float, so an upstream of theirs runs the request (a request
    body) or its count is the largest (reported usage). Raises as `json.loads` does for
    anything else; the second parse runs only after such a refusal."""
    try:
        return json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise
    except ValueError:
        return json.loads(data, parse_int=_saturated_int)


def first_json_value(text: str, start: int = 0) -> Any:
    """The JSON value at `text[start:]`, read as `read_json` reads one, and whatever
    follows it left unread (as Go's `json.Decoder` reads a request)."""
    try:
        return _DECODER.raw_decode(text, start)[0]
    except json.JSONDecodeError:
        raise
    except ValueError:  # an integer of over 4,300 digits
        return _SATURATED.raw_decode(text, start)[0]


def _saturated_int(text: str) -> int:
    if len(text) <= _INT_DIGITS:
        return int(text)
    return -1 if text.startswith("-") else 10**_INT_DIGITS  # token_count caps it


_INT_DIGITS: Final = 30
_DECODER: Final = json.JSONDecoder()
_SATURATED: Final = json.JSONDecoder(parse_int=_saturated_int)


def named_values(parsed: Mapping[str, Any], names: tuple[str, ...]) -> dict[str, list[Any]]:
    """The values of the keys in `names`, also where the body spells a key in another case
    (`Max_Tokens`, or with U+017F for an `s`): Go's encoding/json (Ollama, LocalAI) and ASP.NET read
    JSON keys case-insensitively, so such an upstream honours them. A key spelled twice
    has each of its values listed."""
    found: dict[str, list[Any]] = {}
    for key, value in parsed.items():
        name = key if key in names else key.casefold()
        if name in names:
            found.setdefault(name, []).append(value)
    return found


def output_limits(parsed: Mapping[str, Any]) -> list[int]:
    """Every output limit the body names (providers differ in which key they honour, and
    in whether case matters), as non-negative integers; values that limit nothing are left
    out (`token_count`)."""
    limits = []
    for values in named_values(parsed, OUTPUT_LIMIT_KEYS).values():
        for value in values:
            limit = token_count(value)
            if limit is not None:
                limits.append(limit)
    for config in _generation_configs(parsed):
        for values in named_values(config, GENERATION_LIMIT_KEYS).values():
            for value in values:
                limit = token_count(value)
                if limit is not None:
                    limits.append(limit)
    return limits


def _generation_configs(parsed: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """Gemini's `generationConfig` objects of a body (any spelling of the key)."""
    return [
        config
        for values in named_values(parsed, GENERATION_CONFIG_KEYS).values()
        for config in values
        if isinstance(config, Mapping)
    ]


def output_copies(parsed: Mapping[str, Any]) -> int:
    """How many completions the output limit is spent on, each billed: OpenAI's `n`
    (choices), a legacy completion's `best_of` (generated server-side), once per prompt of
    a batched `prompt` (a list of strings or of token lists), Gemini's `candidateCount`;
    in any case of their keys, the most any spelling asks for."""
    copies = 1
    named = named_values(parsed, _COPIES_AND_PROMPT)
    counts = [value for key in OUTPUT_COPIES_KEYS for value in named.get(key, ())]
    for config in _generation_configs(parsed):
        counts += [v for vs in named_values(config, GENERATION_COPIES_KEYS).values() for v in vs]
    for value in counts:
        count = token_count(value)
        if count is not None and count > copies:
            copies = count
    prompts = 1
    for prompt in named.get("prompt", ()):
        if isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
            prompts = max(prompts, len(prompt))
    return min(copies * prompts, MAX_TOKENS)


def output_estimate(parsed: Mapping[str, Any]) -> int | None:
    """The most output tokens the body lets the upstream generate: the largest output
    limit it names, times its completions (`output_copies`); None without a limit."""
    limits = output_limits(parsed)
    if not limits:
        return None
    return min(max(limits) * output_copies(parsed), MAX_TOKENS)


def estimate_tokens(size: int, parsed: Mapping[str, Any] | None) -> int:
    """Input tokens from the body's size, plus the output estimate when a limit is named."""
    estimate = -(-max(size, 0) // BYTES_PER_TOKEN)
    if parsed is not None:
        output = output_estimate(parsed)
        if output is not None:
            estimate += output
    return min(estimate, MAX_TOKENS)
