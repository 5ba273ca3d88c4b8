# Session 33, call 3 (H200): Kestrel's kernels on the same GPU as ours. The kernel issues' targets
# are Kestrel's published H100 figures; call 2 ran our kernel benchmarks on this H200. Here the peer
# (../shared/peer as .peer: Kestrel 0.4.2 wheels, random MD3 checkpoint) is set up by its own
# run_device.sh (a short MD3 batch-1 run), then tools/profile_peer_kernels.py records every CUDA
# kernel of its engine (torch.profiler) for one greedy request, one sampled request and bursts of
# 4/8/16/32; then our MD3 decode step at 8 and 32 rows (context 800) kernel by kernel (probe).
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
mkdir -p $OUT/x/peer
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/x/3_env.txt
OUT=$OUT/x/peer PEER_MODELS=moondream3-preview PEER_DEADLINE_S=200 \
  PEER_BENCH_ARGS="--concurrency 1 --requests-per-client 1 --ttft-image-sizes 378 --reps 2 --stream-reps 0 --warmup 1" \
  bash .peer/run_device.sh > $OUT/x/3_peer_setup.log 2>&1
echo "peer setup ($SECONDS s): $(grep "compat\|setup done\|single image" $OUT/x/peer/env.log $OUT/x/peer/md3.log | cut -c1-220)"
LD=$(grep -o "LD_LIBRARY_PATH=[^ ]*" $OUT/x/peer/env.log | head -1 | cut -d= -f2)
LT=$(grep -o "PEER_CUBLASLT13=[^ ]*" $OUT/x/peer/env.log | head -1 | cut -d= -f2)
env ${LD:+LD_LIBRARY_PATH=$LD} ${LT:+PEER_CUBLASLT13=$LT} PYTHONPATH=/tmp/site:$PWD HF_HOME=/tmp/peer/hf HF_HUB_OFFLINE=1 \
  TOKENIZERS_PARALLELISM=false timeout $((420 - SECONDS)) python3 tools/profile_peer_kernels.py --peer-dir .peer \
  --weights /tmp/peer/md3/model_fp8.pt --tokenizer /tmp/peer/md3/tokenizer.json --out $OUT/x/3_peer_kernels.json \
  > $OUT/x/3_peer_kernels.log 2>&1
echo "peer kernels ($SECONDS s): $(grep "^== \|Error\|error" $OUT/x/3_peer_kernels.log | cut -c1-200)"
export PYTHONPATH=$PWD
for B in 8 32; do
  [ $SECONDS -lt 500 ] && timeout $((585 - SECONDS)) python3 tools/probe_step_kernels.py --kernels 20 --top 30 --model md3 \
    --kinds decode --batch $B --steps 1 --wall-rounds 5 --json $OUT/x/3_probe_md3_b$B.json 2>&1 | grep -v "$FILT" > $OUT/x/3_probe_md3_b$B.log
  echo "probe b$B ($SECONDS s): $(grep "launches (" $OUT/x/3_probe_md3_b$B.log | head -1)"
done
cd $OUT && tar czf 3_all.tgz x && rm -rf x
