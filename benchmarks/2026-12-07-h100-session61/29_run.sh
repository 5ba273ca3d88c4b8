# Session 61 (2026-12-07): the first call. # Prepared in session 60 (2026-12-07): the next session's first call (sessions 56-60 asked for `nvidia-h200` and
# were lent H100s, or nothing). An H200 runs 1a_run.sh (issue 6's MD3 / MD2 W1 on the card its targets
# name; kept in session 60's folder, as is 1b_run.sh, the next call on the same machine, carrying
# [".peerx"]); an H100 runs 28_run.sh (the lowering cache's cold start). Move the scripts into the
# session's dated folder first and fix the paths.
G=$(nvidia-smi --query-gpu=name --format=csv,noheader)
echo "card: $G"
case "$G" in
  *H200*) bash benchmarks/2026-12-07-h100-session60/1a_run.sh ;;
  *) bash benchmarks/2026-12-07-h100-session61/30_run.sh ;;
esac
