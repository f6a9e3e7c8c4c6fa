"""OpenAI's Responses API (`/v1/responses`): converted to a chat request and back, typed stream
events, and the stored responses behind `previous_response_id` (docs/API.md)."""
