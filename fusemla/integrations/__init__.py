"""Engine integrations. Each engine's glue lives in its own module here and imports the engine
lazily; nothing else in fusemla imports this package except the engine test support
(``fusemla.testing.vllm_worker``). ``vllm``: the vLLM plugin."""
