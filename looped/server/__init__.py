"""An OpenAI-compatible HTTP server on the generation engine (docs/server.md)."""
