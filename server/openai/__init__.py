"""OpenAI's completions and chat (`/v1/completions`, `/v1/chat/completions`, `/v1/models`,
`/tokenize`): the request and response models, tool-call parsing, and `OpenAIServing`, the
admission, fan-out and streaming every API here builds on (Responses and Messages run as chat)."""
