# Session 25, call 3: what bounds the sorted MoE regime's grouped GEMMs. Calls 1-2: at T=1480 the
# one-warpgroup kernel took the same time with 64- and 128-token blocks (~25% fewer FLOPs with 64),
# and the two-consumer kernel (half the L2 -> SMEM traffic per FLOP) was 4% slower. Nsight Compute
# on both GEMM launches of one MoE layer: T=1480 (Nt 128, Nt 64, wide) and T=740 (Nt 128, wide).
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc\|JIT session error\|cuda_timer.cc'
export PYTHONPATH=$PWD
mkdir -p $OUT/x
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/x/3_env.txt
which ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null
NCU=$(which ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
timeout 540 $NCU -k regex:mosaic_gpu_kernel --section SpeedOfLight --section ComputeWorkloadAnalysis \
  --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy --section SchedulerStats \
  --section LaunchStats python3 tools/profile_moe.py 1480 1480:block_tokens=64 1480:wide=1 740 740:wide=1 \
  > $OUT/x/3_ncu_moe.txt 2>&1
echo "ncu ($SECONDS s): $(grep -c 'Section: GPU Speed' $OUT/x/3_ncu_moe.txt) kernels"
grep "calls done\|mosaic_gpu_kernel (\|Duration\|Compute (SM) Throughput\|Memory Throughput\|L2 Cache Throughput\|L1/TEX Cache Throughput\|Executed Ipc A\|Issue Slots Busy\|No Eligible\|Registers Per\|Achieved Occupancy" $OUT/x/3_ncu_moe.txt | grep -v "^==" | head -120
cd $OUT && tar czf 3_all.tgz x && rm -rf x
