"""What crosses between the front end and the engine-core process (and from rank 0 to the other
tensor-parallel ranks): the messages (protocol), how they are serialised (serial), the KV-cache events
the core emits. Plain data: imported by both processes. See docs/architecture.md, "Processes"."""
