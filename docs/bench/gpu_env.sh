# Sourced by the GPU benchmark scripts, from the checkout's root: `. docs/bench/gpu_env.sh MODULE ...` (name the
# modules: without arguments a sourced file sees the calling script's own).
# The device machine's environment (TORCH_CUDA_ARCH_LIST 9.0: the default 9.0a breaks DeepSpeed's op builds; NVLink
# multicast off; offline Hugging Face), and, where one of the MODULEs is not importable, the wheels of
# .whl/ (built by ../shared/tools/offline-wheels.sh and carried to the machine) installed into /tmp/site.
export TORCH_CUDA_ARCH_LIST=9.0 NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
if ! python3 -c "import $(IFS=,; echo "$*")" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/site/bin:$PATH
fi
gpu_settle() {  # gpu_settle PATTERN: after a run cut by `timeout`, its ranks (the launcher's grandchildren) can outlive it
  # and hold the GPU's memory, so the next run starts out of memory. Kills the Python processes whose arguments hold
  # PATTERN (the run's own), then waits up to 60 s until no process holds the GPU (at once without nvidia-smi).
  pkill -9 -f -- "^[^ ]*python[^ ]* .*$1" 2>/dev/null
  local i
  for i in $(seq 60); do
    [ -z "$(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null)" ] && return 0
    sleep 1
  done
  echo "gpu_settle: still on the GPU after 60 s:" \
    "$(nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader | tr '\n' ' ')"
}
