"""Tool calling as text: the tools a chat request offers, the calls a model writes, and the formats
(Hermes, Llama 3 JSON, Mistral, pythonic, plain JSON) that turn one into the other."""
