"""Generation stepped by the server: decode loops of the served language models (docs/serving.md#generation)."""
