# Session 60: call 2 as retried (the first try found no machine; status then offered H200s). An H200 runs
# 1a_run.sh (issue 6's MD3 / MD2 W1 on the card its targets name, with this tree; then 1b_run.sh as the
# next call on the same machine, carrying [".peerx"]); an H100 runs 21_run.sh (carry [".abtree"]).
G=$(nvidia-smi --query-gpu=name --format=csv,noheader)
echo "card: $G"
case "$G" in
  *H200*) bash benchmarks/2026-12-07-h100-session60/1a_run.sh ;;
  *) bash benchmarks/2026-12-07-h100-session60/21_run.sh ;;
esac
