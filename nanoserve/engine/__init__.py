"""The engine: LLM loop (§4), schedulers (§6, §2), BlockManager (§5), ModelRunner (§4, §5)."""
