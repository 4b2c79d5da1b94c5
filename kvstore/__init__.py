"""kvstore: a multi-tier KV-cache daemon for LLM inference workers."""

__version__ = "0.1.0"
