"""Moving KV-cache blocks between processes. Knows nothing of models: it moves described byte ranges."""
