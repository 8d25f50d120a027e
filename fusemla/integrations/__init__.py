"""Engine integrations. Each engine's glue lives in its own module here and imports the engine
lazily; nothing else in fusemla imports this package. ``vllm``: the vLLM plugin."""
