"""`folio bench structured`: what enforcing a JSON schema costs, beside llama.cpp's grammars."""
