# Lease call 3 of 3, within 30 s of call 2. kind: left out (call 1's machine, which holds the bundle).
# carry: nothing  (timeout_s 580)
# Decode steps (graphs vs eager, and the graph replay alone), the decode step's kernels (profile),
# serving tok/s vs transformers at 12B dimensions (SERVING_MODEL=e4b saves about a minute), then the
# mixed step and video prefill against their floors (#35), then the KV cache sized from the GPU with no
# memory flag under up to 64 x 8k-token requests, what its cache seats (capacity, #36; last, so a call that runs long cuts them
# and not the rest); the random checkpoint is written once and shared by all.
set -u
. scripts/gpu_lease/env.sh
[ -d "$B/site" ] || { echo "no unpacked bundle here: the machine was not warm; run calls 1 and 2 again"; exit 3; }
use_site
run_check call3 555 decode profile serving mixed video_prefill capacity --serving-model "${SERVING_MODEL:-12b_unified}"
