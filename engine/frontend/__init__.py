"""What drives the engine: LLMEngine's step, the thread and process loops, the offline LLM, the profiler."""
