"""OpenAI embeddings: the request, the vectors' encodings, the route."""
