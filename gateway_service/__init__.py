"""The OpenAI-compatible HTTP edge: `/v1/completions`, `/v1/chat/completions`, `/v1/models`
and `/health` in front of one or more verifiers (issue 19)."""
