"""Tensor parallelism's processes: rank 0's broadcasting runner, the other ranks' spawn and liveness
(tensor_parallel.py), a worker rank's loop (worker_rank.py), what every rank shares: device, shard,
rendezvous (ranks.py), the per-step messages (step_messages.py), `mmserve worker` for a further node."""
