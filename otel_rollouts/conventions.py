"""Every attribute name, span name and enumerated value the library writes.

Three vocabularies meet on an episode's spans:

* ``rl.*`` — the RL convention of this project (public contract);
* ``gen_ai.*`` — the OpenTelemetry GenAI semantic conventions;
* ``openinference.span.kind`` — so Phoenix and Arize render span kinds.

No other module spells an attribute name as a string literal: import it from here.
"""

from __future__ import annotations

# --- rl.* (ours) -----------------------------------------------------------------------
RL_STEP = "rl.step"
RL_SPLIT = "rl.split"
RL_EPISODE_ID = "rl.episode.id"
RL_GROUP_ID = "rl.group.id"
RL_SAMPLE_INDEX = "rl.sample.index"
RL_POLICY_VERSION = "rl.policy.version"
RL_POLICY_VERSION_MIN = "rl.policy.version.min"
RL_POLICY_VERSION_MAX = "rl.policy.version.max"
RL_REWARD = "rl.reward"
RL_REWARD_PREFIX = "rl.reward."  # rl.reward.<component>
RL_ADVANTAGE = "rl.advantage"
RL_FINISH_REASON = "rl.finish_reason"
RL_STATUS = "rl.status"
RL_TURN_INDEX = "rl.turn.index"
RL_DATASET_NAME = "rl.dataset.name"
RL_DATASET_INDEX = "rl.dataset.index"
RL_FRAMEWORK = "rl.framework"
RL_RUN_ID = "rl.run.id"
RL_METADATA_PREFIX = "rl.metadata."  # rl.metadata.<key> for user metadata
RL_ALIGNMENT = "rl.alignment"
RL_ALIGNMENT_MISSING = "rl.alignment.missing"  # ragged columns that did not cover this sample
RL_STALENESS = "rl.staleness"  # training step - policy version that generated the sample
RL_TRUNCATED_FIELDS = "rl.content.truncated"  # names of attributes whose text was cut
RL_INVALID_FIELDS = "rl.invalid"  # "field: reason" for values that were refused
RL_FEEDBACK_ROLE = "rl.feedback.role"  # env | tool | user for mask-0 spans after the prompt
RL_TOOL_PARSE_ERROR = "rl.tool.parse_error"
RL_TOOL_RUNTIME = "rl.tool.runtime_s"  # a tool call's runtime as the framework measured it
RL_SPAN_KIND = "rl.span.kind"  # span | generation | tool | turn | episode | prompt | reward

# rl.status values
STATUS_OK = "ok"
STATUS_ERROR = "error"
STATUS_TRUNCATED = "truncated"
STATUS_FILTERED = "filtered"
STATUSES = (STATUS_OK, STATUS_ERROR, STATUS_TRUNCATED, STATUS_FILTERED)

# --- gen_ai.* (OpenTelemetry GenAI semantic conventions) ---------------------------------
GEN_AI_OPERATION_NAME = "gen_ai.operation.name"
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
GEN_AI_RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
GEN_AI_TOOL_NAME = "gen_ai.tool.name"
GEN_AI_TOOL_CALL_ID = "gen_ai.tool.call.id"
GEN_AI_TOOL_CALL_ARGUMENTS = "gen_ai.tool.call.arguments"
GEN_AI_TOOL_CALL_RESULT = "gen_ai.tool.call.result"
GEN_AI_INPUT_MESSAGES = "gen_ai.input.messages"
GEN_AI_OUTPUT_MESSAGES = "gen_ai.output.messages"
GEN_AI_CONVERSATION_ID = "gen_ai.conversation.id"
GEN_AI_SYSTEM_INSTRUCTIONS = "gen_ai.system_instructions"
GEN_AI_AGENT_NAME = "gen_ai.agent.name"
GEN_AI_PROVIDER_NAME = "gen_ai.provider.name"
ERROR_TYPE = "error.type"  # on failed spans: the exception's type, or ERROR_TYPE_OTHER
ERROR_TYPE_OTHER = "_OTHER"
# the gen_ai.evaluation.result event: one per score (reward, each component, advantage)
EVENT_GEN_AI_EVALUATION_RESULT = "gen_ai.evaluation.result"
GEN_AI_EVALUATION_NAME = "gen_ai.evaluation.name"
GEN_AI_EVALUATION_SCORE_VALUE = "gen_ai.evaluation.score.value"
EVALUATION_REWARD = "reward"
EVALUATION_ADVANTAGE = "advantage"

# message JSON in the parts shape (gen_ai.input.messages / output.messages / system_instructions)
PART_TEXT = "text"
PART_TOOL_CALL = "tool_call"
PART_TOOL_CALL_RESPONSE = "tool_call_response"
# gen_ai.response.finish_reasons / an output message's finish_reason: the spec's values
FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_CONTENT_FILTER = "content_filter"
FINISH_TOOL_CALL = "tool_call"
FINISH_ERROR = "error"
FINISH_REASON_OF = {  # what frameworks write -> the spec's value (others are kept as they are)
    "stop": FINISH_STOP, "eos": FINISH_STOP, "end_turn": FINISH_STOP, "stop_sequence": FINISH_STOP,
    "length": FINISH_LENGTH, "max_tokens": FINISH_LENGTH, "max_length": FINISH_LENGTH,
    "truncated": FINISH_LENGTH, "context_overflow": FINISH_LENGTH,
    "tool_calls": FINISH_TOOL_CALL, "tool_call": FINISH_TOOL_CALL, "function_call": FINISH_TOOL_CALL,
    "tool_use": FINISH_TOOL_CALL,
    "content_filter": FINISH_CONTENT_FILTER,
    "error": FINISH_ERROR, "abort": FINISH_ERROR,
}

OP_INVOKE_AGENT = "invoke_agent"
OP_CHAT = "chat"
OP_EXECUTE_TOOL = "execute_tool"

# --- OpenInference --------------------------------------------------------------------------
OPENINFERENCE_SPAN_KIND = "openinference.span.kind"
OI_AGENT = "AGENT"
OI_CHAIN = "CHAIN"
OI_LLM = "LLM"
OI_TOOL = "TOOL"
OI_EVALUATOR = "EVALUATOR"
OPENINFERENCE_PROJECT_NAME = "openinference.project.name"  # resource attribute read by Phoenix

# --- generic input/output of @traced spans --------------------------------------------------
INPUT_VALUE = "input.value"  # OpenInference's name; JSON text
OUTPUT_VALUE = "output.value"
INPUT_MIME_TYPE = "input.mime_type"
OUTPUT_MIME_TYPE = "output.mime_type"
MIME_TEXT = "text/plain"
MIME_JSON = "application/json"

# --- OpenInference views (written at materialisation, so Phoenix and Arize render everything) -
OI_LLM_MODEL_NAME = "llm.model_name"
OI_LLM_PROVIDER = "llm.provider"
OI_LLM_INPUT_MESSAGES = "llm.input_messages"  # flattened: llm.input_messages.<i>.message.role
OI_LLM_OUTPUT_MESSAGES = "llm.output_messages"
OI_LLM_TOKEN_COUNT_PROMPT = "llm.token_count.prompt"
OI_LLM_TOKEN_COUNT_COMPLETION = "llm.token_count.completion"
OI_LLM_TOKEN_COUNT_TOTAL = "llm.token_count.total"
OI_MESSAGE = "message"
OI_MESSAGE_ROLE = "message.role"
OI_MESSAGE_CONTENT = "message.content"
OI_MESSAGE_NAME = "message.name"
OI_MESSAGE_TOOL_CALL_ID = "message.tool_call_id"
OI_MESSAGE_TOOL_CALLS = "message.tool_calls"
OI_TOOL_CALL_ID = "tool_call.id"
OI_TOOL_CALL_FUNCTION_NAME = "tool_call.function.name"
OI_TOOL_CALL_FUNCTION_ARGUMENTS = "tool_call.function.arguments"
OI_TOOL_NAME = "tool.name"
OI_SESSION_ID = "session.id"
OI_METADATA = "metadata"
OI_TAG_TAGS = "tag.tags"


def oi_message_key(prefix: str, index: int, field: str) -> str:
    """``llm.input_messages.<index>.message.role`` and friends (OpenInference's flattening)."""
    return f"{prefix}.{index}.{field}"


def oi_tool_call_key(prefix: str, index: int, call: int, field: str) -> str:
    """``llm.output_messages.<i>.message.tool_calls.<j>.tool_call.function.name`` and friends."""
    return f"{prefix}.{index}.{OI_MESSAGE_TOOL_CALLS}.{call}.{field}"

# --- exception events (OpenTelemetry semantic conventions) ----------------------------------
EXCEPTION_TYPE = "exception.type"
EXCEPTION_MESSAGE = "exception.message"
EXCEPTION_STACKTRACE = "exception.stacktrace"
EVENT_EXCEPTION = "exception"

# --- span names (contract) ------------------------------------------------------------------
SPAN_EPISODE = "episode"
SPAN_PROMPT = "prompt"
SPAN_TURN = "turn"
SPAN_REWARD = "reward"
SPAN_FEEDBACK = "feedback"  # what the environment (or a user, or a tool) said back after a turn
SPAN_CHAT = "chat"  # "chat {model}" when a model is known
SPAN_EXECUTE_TOOL = "execute_tool"  # "execute_tool {tool}"


def chat_span_name(model: str | None) -> str:
    """``chat {model}`` per the GenAI conventions, or ``chat`` when the model is unknown."""
    return f"{SPAN_CHAT} {model}" if model else SPAN_CHAT


def tool_span_name(tool: str | None) -> str:
    """``execute_tool {tool}`` per the GenAI conventions."""
    return f"{SPAN_EXECUTE_TOOL} {tool}" if tool else SPAN_EXECUTE_TOOL


# --- our span kinds -> the other vocabularies -----------------------------------------------
KIND_SPAN = "span"
KIND_GENERATION = "generation"
KIND_TOOL = "tool"
KIND_TURN = "turn"
KIND_EPISODE = "episode"
KIND_PROMPT = "prompt"
KIND_REWARD = "reward"
TRACED_KINDS = (KIND_SPAN, KIND_GENERATION, KIND_TOOL, KIND_TURN, KIND_EPISODE)

OPENINFERENCE_KIND_OF = {
    KIND_EPISODE: OI_AGENT,
    KIND_TURN: OI_CHAIN,
    KIND_PROMPT: OI_CHAIN,
    KIND_GENERATION: OI_LLM,
    KIND_TOOL: OI_TOOL,
    KIND_REWARD: OI_EVALUATOR,
    KIND_SPAN: OI_CHAIN,
}
OPERATION_OF = {
    KIND_EPISODE: OP_INVOKE_AGENT,
    KIND_GENERATION: OP_CHAT,
    KIND_TOOL: OP_EXECUTE_TOOL,
}

# --- environment variables ------------------------------------------------------------------
ENV_CAPTURE_CONTENT = "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT"
ENV_SDK_DISABLED = "OTEL_SDK_DISABLED"
ENV_SERVICE_NAME = "OTEL_SERVICE_NAME"
ENV_OTLP_ENDPOINT = "OTEL_EXPORTER_OTLP_ENDPOINT"
ENV_OTLP_TRACES_ENDPOINT = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
ENV_OTLP_PROTOCOL = "OTEL_EXPORTER_OTLP_PROTOCOL"
ENV_OTLP_TRACES_PROTOCOL = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
ENV_OTLP_METRICS_PROTOCOL = "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL"
ENV_OTLP_LOGS_PROTOCOL = "OTEL_EXPORTER_OTLP_LOGS_PROTOCOL"
ENV_TRACKIO_PROJECT = "OTEL_ROLLOUTS_TRACKIO_PROJECT"
ENV_TRACE_UI_URL = "OTEL_ROLLOUTS_TRACE_UI_URL"  # e.g. http://localhost:16686 (Jaeger)

# --- resource attributes ----------------------------------------------------------------------
SERVICE_NAME = "service.name"
SERVICE_INSTANCE_ID = "service.instance.id"

# --- instrumentation scope ------------------------------------------------------------------
SCOPE_NAME = "otel_rollouts"

# --- correlation with infrastructure telemetry (resource, metrics, logs) ---------------------
RL_RANK = "rl.rank"  # resource: this process's rank (torch.distributed or env RANK)
RL_LOCAL_RANK = "rl.local_rank"
RL_WORLD_SIZE = "rl.world_size"
RL_DROP_REASON = "rl.drop.reason"  # metric attribute: why the sampler dropped an episode
GEN_AI_TOKEN_TYPE = "gen_ai.token.type"  # metric attribute: input | output (GenAI conventions)
ENV_METRICS_EXPORTER = "OTEL_METRICS_EXPORTER"
ENV_LOGS_EXPORTER = "OTEL_LOGS_EXPORTER"
METRIC_EPISODES_SEEN = "rl.episodes.seen"
METRIC_EPISODES_KEPT = "rl.episodes.kept"
METRIC_EPISODES_DROPPED = "rl.episodes.dropped"
METRIC_REWARD = "rl.reward"
METRIC_EPISODE_DURATION = "rl.episode.duration"
METRIC_TOKENS = "rl.tokens"
METRIC_TOOL_ERRORS = "rl.tool.errors"
# log record attributes (Python identifiers: LogRecord fields, usable in format strings)
LOG_TRACE_ID = "trace_id"
LOG_SPAN_ID = "span_id"
LOG_RL_STEP = "rl_step"
LOG_RL_EPISODE_ID = "rl_episode_id"
