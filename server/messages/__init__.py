"""Anthropic's Messages API (`/v1/messages`, `count_tokens`): converted to chat and back, with
Anthropic's stream events and error shape (docs/API.md)."""
