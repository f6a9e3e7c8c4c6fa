"""The HTTP front end: OpenAI-compatible routes, validation, streaming and metrics.

Thin by design: it parses and validates requests, hands them to `engine.core.async_engine.AsyncLLM`, and
streams what comes back. No engine logic lives here.
"""
