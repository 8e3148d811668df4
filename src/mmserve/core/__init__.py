"""The engine-core process: its entry point and loop (process.py), EngineCore's step loop
(engine_core.py; the async loop: async_loop.py), the scheduler (sched/) and the KV-cache manager
(kv_cache/). Runs in the spawned engine process (or a thread with --no-engine-process); the front
end imports none of it."""
