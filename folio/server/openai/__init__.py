"""The OpenAI API: completions, chat completions, embeddings, Responses and batch files. Its chat
request is the common form every API's chat is translated into (openai/chat/)."""
