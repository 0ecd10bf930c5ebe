"""OpenAI-compatible HTTP server: protocol, app factory, completion and chat handlers."""
