"""Built-in tasks and the tiny models they run on (no hub download needed)."""
