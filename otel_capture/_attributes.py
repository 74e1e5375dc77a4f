"""Span attribute names, in one table (GenAI semantic conventions v1.41.1 plus ours).

Defined here rather than imported from ``opentelemetry.semconv._incubating``: that module is explicitly
unstable and renames keys between releases (vLLM keeps its own table for the same reason).
"""

from __future__ import annotations

GEN_AI_OPERATION_NAME = "gen_ai.operation.name"
GEN_AI_PROVIDER_NAME = "gen_ai.provider.name"
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_REQUEST_STREAM = "gen_ai.request.stream"
GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
GEN_AI_REQUEST_TOP_K = "gen_ai.request.top_k"
GEN_AI_REQUEST_SEED = "gen_ai.request.seed"
GEN_AI_REQUEST_FREQUENCY_PENALTY = "gen_ai.request.frequency_penalty"
GEN_AI_REQUEST_PRESENCE_PENALTY = "gen_ai.request.presence_penalty"
GEN_AI_REQUEST_STOP_SEQUENCES = "gen_ai.request.stop_sequences"
GEN_AI_REQUEST_CHOICE_COUNT = "gen_ai.request.choice.count"
GEN_AI_OUTPUT_TYPE = "gen_ai.output.type"
GEN_AI_CONVERSATION_ID = "gen_ai.conversation.id"
GEN_AI_RESPONSE_ID = "gen_ai.response.id"
GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
GEN_AI_RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK = "gen_ai.response.time_to_first_chunk"
GEN_AI_USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS = "gen_ai.usage.cache_read.input_tokens"
GEN_AI_USAGE_CACHE_CREATION_INPUT_TOKENS = "gen_ai.usage.cache_creation.input_tokens"
GEN_AI_USAGE_REASONING_OUTPUT_TOKENS = "gen_ai.usage.reasoning.output_tokens"
OPENAI_API_TYPE = "openai.api.type"
OPENAI_REQUEST_SERVICE_TIER = "openai.request.service_tier"
OPENAI_RESPONSE_SERVICE_TIER = "openai.response.service_tier"
OPENAI_RESPONSE_SYSTEM_FINGERPRINT = "openai.response.system_fingerprint"
SERVER_ADDRESS = "server.address"
SERVER_PORT = "server.port"
HTTP_RESPONSE_STATUS_CODE = "http.response.status_code"
HTTP_ROUTE = "http.route"  # on the HTTP server span: a model call's route, without the rollout prefix
ERROR_TYPE = "error.type"

# The HTTP server span (stable HTTP semantic conventions; otel_capture._telemetry.server_span).
HTTP_REQUEST_METHOD = "http.request.method"
HTTP_REQUEST_METHOD_ORIGINAL = "http.request.method_original"
HTTP_REQUEST_HEADER_PREFIX = "http.request.header."  # + the header's lower-case name
HTTP_RESPONSE_HEADER_PREFIX = "http.response.header."
URL_SCHEME = "url.scheme"
URL_PATH = "url.path"
URL_QUERY = "url.query"
CLIENT_ADDRESS = "client.address"
USER_AGENT_ORIGINAL = "user_agent.original"
NETWORK_PROTOCOL_VERSION = "network.protocol.version"

# Opt-in content (JSON text on spans, only when OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT asks).
GEN_AI_INPUT_MESSAGES = "gen_ai.input.messages"
GEN_AI_OUTPUT_MESSAGES = "gen_ai.output.messages"
GEN_AI_SYSTEM_INSTRUCTIONS = "gen_ai.system_instructions"
GEN_AI_TOOL_DEFINITIONS = "gen_ai.tool.definitions"

# Ours: the correlation and the link to the JSONL record.
ROLLOUT_ID = "rollout.id"
ROLLOUT_ID_BAGGAGE = "rollout.id.baggage"  # set only when baggage disagreed with the URL prefix
MODEL_CALL_ID = "otel_capture.model_call.id"
MODEL_CALL_DIALECT = "otel_capture.model_call.dialect"  # the uncorrelated-calls counter's; not on spans (provider + openai.api.type say it)
MODEL_CALL_ROLLOUT_SOURCE = "otel_capture.rollout.source"  # url_prefix, header, api_key, session_id, baggage
# why the token ids or log-probs the request asked for are not all in the answer (docs/tokens.md)
MODEL_CALL_TOKENS_MISSING = "otel_capture.model_call.tokens_missing"
# which token invariant the answer breaks: odd entries, log-probs against ids, ids against the usage
MODEL_CALL_TOKEN_MISMATCH = "otel_capture.model_call.token_mismatch"
# The weight (policy) version (docs/attachment.md, "Weight versions"): in force at admission, declared at
# the end when it differs, and what the engine reported.
WEIGHT_VERSION = "otel_capture.weight_version"
WEIGHT_VERSION_AT_END = "otel_capture.weight_version_at_end"
ENGINE_WEIGHT_VERSION = "otel_capture.engine_weight_version"

OPERATION_CHAT = "chat"
OPERATION_TEXT_COMPLETION = "text_completion"  # /v1/completions

# Metrics (GenAI semconv v1.41.1 gen-ai-metrics.md): name, unit, description, explicit bucket boundaries.
METRIC_SERVER_REQUEST_DURATION = "gen_ai.server.request.duration"
METRIC_SERVER_TIME_TO_FIRST_TOKEN = "gen_ai.server.time_to_first_token"
METRIC_SERVER_TIME_PER_OUTPUT_TOKEN = "gen_ai.server.time_per_output_token"
BUCKETS_REQUEST_DURATION = (
    0.01,
    0.02,
    0.04,
    0.08,
    0.16,
    0.32,
    0.64,
    1.28,
    2.56,
    5.12,
    10.24,
    20.48,
    40.96,
    81.92,
)
BUCKETS_TIME_TO_FIRST_TOKEN = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
)
BUCKETS_TIME_PER_OUTPUT_TOKEN = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
)
METRIC_HTTP_SERVER_REQUEST_DURATION = "http.server.request.duration"  # the HTTP server span's one metric
BUCKETS_HTTP_SERVER_REQUEST_DURATION = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
)
# The low-cardinality span attributes that metrics carry (never rollout.id: one series per rollout).
METRIC_ATTRIBUTES = (
    GEN_AI_OPERATION_NAME,
    GEN_AI_PROVIDER_NAME,
    GEN_AI_REQUEST_MODEL,
    GEN_AI_RESPONSE_MODEL,
    SERVER_ADDRESS,
    SERVER_PORT,
    ERROR_TYPE,
)
