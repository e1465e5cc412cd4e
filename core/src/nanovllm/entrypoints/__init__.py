"""Ways to run the engine other than the offline ``LLM``: the OpenAI-compatible server.

The server's own options (beside the engine's) have their defaults here, where the command line reads them
without importing the server's dependencies."""

# seconds SIGTERM lets the requests in flight finish before the rest are aborted (vLLM's --shutdown-timeout)
DEFAULT_SHUTDOWN_TIMEOUT = 30.0
# the largest request body read, in bytes (vLLM's Rust front-end: VLLM_HTTP_MAX_JSON_BODY_SIZE, 32 MiB)
DEFAULT_MAX_JSON_BODY_SIZE = 32 << 20
