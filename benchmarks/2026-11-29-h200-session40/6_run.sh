# Session 40, call 6 (H200, the last ~4 device minutes): ptxas's report (registers, spills, wgmma
# serialisation warnings) for the prefill kernel's default 740-token build and its `overlap`
# variant, to see why the overlap measured no gain in calls 2-3.
export PYTHONPATH=$PWD
mkdir -p $OUT/x
timeout 150 python3 tools/bench_attention.py --tune --tune-prefill-only --variants "3wg,R64,ov" --ptxas-info \
  --iters 3 --budget-s 40 > $OUT/x/6_ptxas.log 2>&1
echo "rc $? ($SECONDS s)"
grep -i "wgmma\|serializ\|registers\|spill\|Compiling entry\|^prefill" $OUT/x/6_ptxas.log | cut -c1-300 | head -40
cd $OUT && tar czf 6_all.tgz x && rm -rf x
