"""What a provider's parsed answer says about token usage and the model, in each provider's
own shape: OpenAI's `usage.prompt_tokens` / `completion_tokens`, Anthropic's
`input_tokens` (plus its cache's counts) / `output_tokens`, Bedrock's `inputTokens` /
`outputTokens`, Gemini's `usageMetadata`, Ollama's top-level `prompt_eval_count` /
`eval_count`, and the nestings of Anthropic's `message_start`, the Responses API's stream
and Groq's last chunk. The usage meter (request/usage.py) finds the documents in a body;
these read them into its `Usage`. Each returns whether a token count was reported."""

from __future__ import annotations

from typing import Any, Final

from fallback_mw.request.context import MAX_NAME, Usage
from fallback_mw.tokens import MAX_TOKENS, token_count


def read_document(target: Usage, document: Any) -> bool:
    if isinstance(document, list):
        # Gemini's `:streamGenerateContent` without `alt=sse`: one JSON array of the
        # chunks, each with the `usageMetadata` so far. Only that: a listing of past
        # requests' `usage` is no usage of this one.
        reported = False
        for item in document:
            if isinstance(item, dict):
                _read_model(target, item.get("modelVersion"))
                reported = read_gemini(target, item.get("usageMetadata")) or reported
        return reported
    if not isinstance(document, dict):
        return False
    reported = False
    # Gemini / Vertex AI: `usageMetadata`, the model in `modelVersion`. (Each shape is
    # looked for by its keys first: every answer the meter parses pays for the lookups.)
    if "usageMetadata" in document or "modelVersion" in document:
        _read_model(target, document.get("modelVersion"))
        reported = read_gemini(target, document.get("usageMetadata"))
    # Ollama's own API: the last object (or NDJSON line) counts at the top level.
    if "eval_count" in document or "prompt_eval_count" in document:
        reported = (
            _read_counts(
                target,
                _reported_count(document.get("prompt_eval_count")),
                _reported_count(document.get("eval_count")),
            )
            or reported
        )
    # Anthropic `message_start` nests it in `message`; the OpenAI Responses API's
    # stream in `response` (`response.created`, `response.completed`); Groq's stream
    # in its last chunk's `x_groq`.
    for key in ("message", "response", "x_groq"):
        nested = document.get(key)
        if isinstance(nested, dict):
            _read_model(target, nested.get("model"))
            reported = read_usage(target, nested.get("usage")) or reported
    _read_model(target, document.get("model"))
    return read_usage(target, document.get("usage")) or reported


def _read_model(target: Usage, model: Any) -> None:
    if isinstance(model, str) and model and target.model is None:
        target.model = model[:MAX_NAME]


def read_usage(target: Usage, usage: Any) -> bool:
    """A `usage` object, in the OpenAI, Anthropic or Bedrock spelling."""
    if not isinstance(usage, dict):
        return False
    input_tokens = output_tokens = None
    # AWS Bedrock's Converse API spells them `inputTokens` / `outputTokens`.
    for key in ("prompt_tokens", "input_tokens", "inputTokens"):
        value = _reported_count(usage.get(key))
        if value is not None:
            # Anthropic's input_tokens (and Bedrock's inputTokens) leaves out the
            # prompt written to and read from its cache (billed too): they count as
            # input, as the GenAI conventions' gen_ai.usage.input_tokens includes
            # cached tokens.
            for cached in _CACHE_KEYS.get(key, ()):
                extra = _reported_count(usage.get(cached))
                if extra is not None:
                    value = min(value + extra, MAX_TOKENS)
            input_tokens = value
            break
    for key in ("completion_tokens", "output_tokens", "outputTokens"):
        value = _reported_count(usage.get(key))
        if value is not None:
            output_tokens = value
            break
    return _read_counts(target, input_tokens, output_tokens)


def read_gemini(target: Usage, usage: Any) -> bool:
    """Gemini's `usageMetadata`: `promptTokenCount` (cached content included) and the
    tool-use prompt are input; `candidatesTokenCount` and the thinking model's
    `thoughtsTokenCount` are output, billed at the output price."""
    if not isinstance(usage, dict):
        return False
    return _read_counts(
        target, _sum_counts(usage, _GEMINI_INPUT_KEYS), _sum_counts(usage, _GEMINI_OUTPUT_KEYS)
    )


def _read_counts(target: Usage, input_tokens: int | None, output_tokens: int | None) -> bool:
    # A count only grows over one response (Anthropic's output count is cumulative;
    # OpenAI reports once): the largest reported stands, so a later event saying less
    # (one the SDKs skip, e.g. an unknown `event:` name) cannot lower the charge.
    if input_tokens is not None and (
        target.input_tokens is None or input_tokens > target.input_tokens
    ):
        target.input_tokens = input_tokens
    if output_tokens is not None and (
        target.output_tokens is None or output_tokens > target.output_tokens
    ):
        target.output_tokens = output_tokens
    return input_tokens is not None or output_tokens is not None


def _reported_count(value: Any) -> int | None:
    """A reported token count (`token_count`), where one too large for a float (`1e400`,
    `Infinity`: the SDKs read `inf`) is the largest, as 1e300 or 10^5000 is."""
    if type(value) is int:  # what nearly every answer reports: token_count's, without a call
        return min(value, MAX_TOKENS) if value >= 0 else None
    if isinstance(value, float) and value == _INFINITY:
        return MAX_TOKENS
    return token_count(value)


def _sum_counts(usage: dict[str, Any], keys: tuple[str, ...]) -> int | None:
    """The sum of the counts `usage` reports under `keys` (None: none reported)."""
    total = None
    for key in keys:
        value = _reported_count(usage.get(key))
        if value is not None:
            total = min((total or 0) + value, MAX_TOKENS)
    return total


_INFINITY: Final = float("inf")
_CACHE_KEYS: Final = {
    "input_tokens": ("cache_creation_input_tokens", "cache_read_input_tokens"),  # Anthropic
    "inputTokens": ("cacheWriteInputTokens", "cacheReadInputTokens"),  # Bedrock Converse
}
_GEMINI_INPUT_KEYS: Final = ("promptTokenCount", "toolUsePromptTokenCount")
_GEMINI_OUTPUT_KEYS: Final = ("candidatesTokenCount", "thoughtsTokenCount")
