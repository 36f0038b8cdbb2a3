"""OpenAI chat completions: the request, its messages, the prompt a chat template makes of them, the routes."""
