# Lease call 3 of 3, within 30 s of call 2. carry: nothing  (timeout_s 580)
# Decode steps (graphs vs eager, and the graph replay alone), the decode step's kernels (profile),
# serving tok/s vs transformers, and the KV cache sized from the GPU with no memory flag under 64 x
# 8k-token requests (capacity), at 12B dimensions (SERVING_MODEL=e4b saves about a minute); the random
# checkpoint is written once and shared by all four.
set -u
. scripts/gpu_lease/env.sh
[ -d "$B/site" ] || { echo "no unpacked bundle here: the machine was not warm; run calls 1 and 2 again"; exit 3; }
use_site
run_check call3 555 decode profile serving capacity --serving-model "${SERVING_MODEL:-12b_unified}"
