# Session 25, call 4 (call 3's ncu process segfaulted at start with seven sections and five cases;
# a single-section run of one case then worked): fewer sections, T=1480 only.
export PYTHONPATH=$PWD
mkdir -p $OUT/x
timeout 280 ncu -k regex:mosaic_gpu_kernel --section SpeedOfLight --section ComputeWorkloadAnalysis \
  --section WarpStateStats --section Occupancy python3 tools/profile_moe.py 1480 1480:block_tokens=64 1480:wide=1 \
  > $OUT/x/4_ncu_moe.txt 2>&1
echo "ncu ($SECONDS s): $(grep -c 'Section: GPU Speed' $OUT/x/4_ncu_moe.txt) kernels"
grep "calls done\|mosaic_gpu_kernel (\|Duration\|Compute (SM) Throughput\|Memory Throughput\|L2 Cache Throughput\|L1/TEX Cache Throughput\|Executed Ipc A\|Issue Slots Busy\|Registers Per\|Achieved Occupancy\|Stall\|Warp Cycles Per Issued" $OUT/x/4_ncu_moe.txt | grep -v "^==" | cut -c1-110 | head -90
tail -3 $OUT/x/4_ncu_moe.txt
cd $OUT && tar czf 4_all.tgz x && rm -rf x
