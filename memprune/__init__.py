"""memprune: keep the long-term memory of multi-session chatbots small and useful."""

__version__ = "0.1.0"
