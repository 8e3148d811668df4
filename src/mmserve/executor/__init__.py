"""Tensor parallelism's processes: rank 0's broadcasting runner, the other ranks' spawn, loop and
liveness (tensor_parallel.py), the per-step messages (step_messages.py), `mmserve worker` for a further node."""
