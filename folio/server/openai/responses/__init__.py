"""OpenAI's Responses API: the request, its output items, the event stream, the route."""
