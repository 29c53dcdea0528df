"""OpenAI's Responses API (`/v1/responses`) on the same queues, with its conversation state
in Redis so that any gateway continues any conversation."""
