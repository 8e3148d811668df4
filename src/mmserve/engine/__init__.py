"""The engine: EngineCore's step loop (core), its asyncio face (async_engine), the model runner,
sampling and stopping, observer hooks, and the offline LLM. See docs/architecture.md."""
