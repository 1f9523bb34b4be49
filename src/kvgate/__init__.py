"""kvgate: admission gate for LLM inference traffic."""
