# Share the GPU among this shell's CUDA processes through CUDA MPS (on the device machine), e.g.
# before eight parallel seed-split runs (1.68x the throughput of time-slicing on one H200,
# docs/EXPERIMENTS.md section 14):
#   source research/mps_env.sh && bash research/gpu_batch.sh split8 ...
# Sets the pipe and log folders every MPS client must see, then starts the control daemon unless one
# runs (it stays for later device calls on the same machine; `echo quit | "$MPS_CONTROL"` stops it).
# Without the daemon's binary the processes simply time-slice the GPU, as without this file.
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
MPS_CONTROL=$(command -v nvidia-cuda-mps-control || ls /usr/local/nvidia/bin/nvidia-cuda-mps-control \
              /usr/local/cuda/bin/nvidia-cuda-mps-control /usr/bin/nvidia-cuda-mps-control 2> /dev/null | head -1)
if [ -z "$MPS_CONTROL" ]; then
  echo "mps: no nvidia-cuda-mps-control on this machine; the processes time-slice the GPU"
elif "$MPS_CONTROL" -d 2> /dev/null; then
  echo "mps: control daemon started ($MPS_CONTROL)"
else
  echo "mps: control daemon already running (or refused to start: $CUDA_MPS_LOG_DIRECTORY/control.log)"
fi
