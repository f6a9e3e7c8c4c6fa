"""The HTTP front end: one room per API (`openai/`: completions and chat, `responses/`,
`messages/`) beside the shared plumbing (`app.py`, `errors.py`, `request_body.py`, `metrics.py`,
`settings.py`, `command.py` for `specserve serve`) and the `playground/` page.

Thin by design: it parses and validates requests, hands them to `engine.core.async_engine.AsyncLLM`,
and streams what comes back. No engine logic lives here.
"""
