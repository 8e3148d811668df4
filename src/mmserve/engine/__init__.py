"""The engine. Front end: AsyncEngine (streams), OutputProcessor (detokenise, stop strings, observer),
CoreClient, input processor. Engine process: core_proc running EngineCore's step loop (model runner,
sampler). Between them: protocol (what crosses) and serial (how). Offline: LLM. See docs/architecture.md."""
