"""The decoder (Llama family) and its loader: the model a step runs (§4)."""
