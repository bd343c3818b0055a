"""The span attribute names of the OpenTelemetry GenAI semantic conventions and of OpenInference.

One list for both directions (issue 58): `rlproxy import` reads them (traces/readers/otlp.py), the
OTLP export writes them. The GenAI names are the conventions' (semconv 1.37+, "Development"
status: `gen_ai.input.messages`/`gen_ai.output.messages` hold JSON lists of messages made of typed
`parts`); `opentelemetry-instrumentation-openai-v2` 2.4b0 writes them on the span when told to
(`OTEL_SEMCONV_STABILITY_OPT_IN=gen_ai_latest_experimental`,
`OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=SPAN_ONLY`), else it puts the content in log
events named `EVENT_*` below. OpenInference (Arize: Phoenix) flattens messages into indexed keys
(`llm.input_messages.0.message.role`), built by `oi_message`.
"""

from __future__ import annotations

# -- OpenTelemetry GenAI semantic conventions --------------------------------------------------
OPERATION = "gen_ai.operation.name"  # chat, text_completion, embeddings, execute_tool, ...
PROVIDER = "gen_ai.provider.name"  # openai, anthropic, ... (semconv 1.37+)
SYSTEM = "gen_ai.system"  # the same, before 1.37
REQUEST_MODEL = "gen_ai.request.model"
RESPONSE_MODEL = "gen_ai.response.model"
RESPONSE_ID = "gen_ai.response.id"
FINISH_REASONS = "gen_ai.response.finish_reasons"  # list, one per choice
INPUT_TOKENS = "gen_ai.usage.input_tokens"
OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
INPUT_MESSAGES = "gen_ai.input.messages"  # JSON: [{"role", "parts": [{"type": "text", "content"}, ...]}]
OUTPUT_MESSAGES = "gen_ai.output.messages"  # JSON: the same, with "finish_reason"
SYSTEM_INSTRUCTIONS = "gen_ai.system_instructions"  # JSON: parts, when kept apart from the messages
TOOL_DEFINITIONS = "gen_ai.tool.definitions"  # JSON: the tools offered
CONVERSATION_ID = "gen_ai.conversation.id"
# request parameters: gen_ai.request.<name> -> the chat request's <name>
REQUEST_PARAMS = {
    "gen_ai.request.temperature": "temperature",
    "gen_ai.request.top_p": "top_p",
    "gen_ai.request.max_tokens": "max_tokens",
    "gen_ai.request.seed": "seed",
    "gen_ai.request.frequency_penalty": "frequency_penalty",
    "gen_ai.request.presence_penalty": "presence_penalty",
    "gen_ai.request.stop_sequences": "stop",
}
# message parts (the JSON schema of gen_ai.input.messages)
PART_TEXT = "text"  # {"type": "text", "content": str}
PART_TOOL_CALL = "tool_call"  # {"type": "tool_call", "id", "name", "arguments": object}
PART_TOOL_RESPONSE = "tool_call_response"  # {"type": "tool_call_response", "id", "response"}
# content as log or span events (older instrumentations; the event's body holds the message)
EVENT_MESSAGES = {
    "gen_ai.system.message": "system",
    "gen_ai.user.message": "user",
    "gen_ai.assistant.message": "assistant",
    "gen_ai.tool.message": "tool",
}
EVENT_CHOICE = "gen_ai.choice"  # body {"index", "finish_reason", "message": {...}}

# -- OpenInference (openinference-semantic-conventions) -----------------------------------------
OI_SPAN_KIND = "openinference.span.kind"  # LLM for a model call
OI_MODEL = "llm.model_name"
OI_PROVIDER = "llm.provider"
OI_INVOCATION_PARAMETERS = "llm.invocation_parameters"  # JSON of the request's parameters
OI_INPUT_MESSAGES = "llm.input_messages"  # + .N.message.<field>
OI_OUTPUT_MESSAGES = "llm.output_messages"
OI_TOOLS = "llm.tools"  # + .N.tool.json_schema (JSON of one tool)
OI_PROMPT_TOKENS = "llm.token_count.prompt"
OI_COMPLETION_TOKENS = "llm.token_count.completion"
OI_INPUT_VALUE = "input.value"  # the request body as JSON (input.mime_type application/json)
OI_OUTPUT_VALUE = "output.value"
OI_SESSION_ID = "session.id"


def oi_message(prefix: str, n: int, field: str) -> str:
    """An OpenInference message key: `llm.input_messages.0.message.role` (`field` = role, content,
    name, tool_call_id, or `tool_calls.K.tool_call.function.name` and its siblings)."""
    return f"{prefix}.{n}.message.{field}"
