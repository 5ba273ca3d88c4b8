set -x
export PYTHONPATH=$PWD:$PWD/.scratch/site
FILT='cuda_event.cc\|cuda_stream.cc\|^===\|^external\|^$\|cuda_executor\|cuda_host_alloc\|local_device_state\|cuda_device_alloc'
python3 -c "import flatbuffers; print('flatbuffers', flatbuffers.__file__)"
EA="decode_buckets=1,8,16,32,64 prefill_token_buckets=1024,2048 runner.vision_buckets=2,10,13"
rm -rf /tmp/cc2
python3 tools/benchmark.py --model md3 --random-weights --workloads startup --compile-cache /tmp/cc2 --engine-args $EA --out $OUT/1_st_cold.json 2>&1 | grep -v "$FILT" > $OUT/1_st_cold.log
du -sh /tmp/cc2; ls /tmp/cc2/kestrel_jax_export | head -30
python3 tools/benchmark.py --model md3 --random-weights --workloads startup --compile-cache /tmp/cc2 --engine-args $EA --out $OUT/2_st_warm.json 2>&1 | grep -v "$FILT" > $OUT/2_st_warm.log
python3 tools/benchmark.py --model md3 --random-weights --workloads w2 --concurrency 64 --requests-per-client 8 --compile-cache /tmp/cc2 --engine-args $EA --out $OUT/3_w2.json 2>&1 | grep -v "$FILT" > $OUT/3_w2.log
tail -5 $OUT/*.log
