"""The engine: LLM loop (§4), Scheduler (§6) and StaticScheduler (§2), BlockManager (§5),
ModelRunner (§4, §5)."""
