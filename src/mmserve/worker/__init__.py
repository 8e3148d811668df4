"""The worker: the model runner and what it owns (step inputs, block tables, sampled rows, CUDA
graphs, the encoder cache, the backends' start-up check, the CPU thread pool). Runs in the engine-core
process and in every tensor-parallel rank."""
