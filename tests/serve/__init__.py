"""The server on every engine (hf, fast, gguf, bnb) through real HTTP and the official client."""
