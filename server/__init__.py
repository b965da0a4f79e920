"""HTTP front end (Anthropic- and OpenAI-compatible). Knows nothing of JAX: it talks to the engine's async API."""
