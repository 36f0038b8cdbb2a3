"""Ollama's API (/api/*): generate, chat, embed, and the model listing routes."""
