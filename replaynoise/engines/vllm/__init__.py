"""The vLLM engine: a stock serving engine's prefix-cache resume, and how it is built."""
