# The Kestrel side-by-side harness (.peer, provided beside the checkout) is 48.6 MB, almost all of it
# one wheel (kestrel_kernels, 45.6 MB, deflate); with the tracked tree it passes the 64 MiB that a
# device call carries. `pack` writes .peerx: .peer with that wheel's files as one tar.xz (21.9 MB);
# `unpack`, on the device, rebuilds the wheel (a stored zip of the same files: pip checks the files
# against the wheel's RECORD, not the archive) and leaves the harness at .peer again.
#   here:        bash tools/peer_carry.sh pack      (then carry [".peerx"]; add /.peerx/ to .git/info/exclude)
#   on a device: bash tools/peer_carry.sh unpack && bash .peer/run_device.sh
set -euo pipefail
cmd=${1:?pack or unpack}
case $cmd in
pack)
  [ -d .peer ] || { echo "no .peer here" >&2; exit 1; }
  rm -rf .peerx && mkdir .peerx
  tar cf - -C .peer --exclude='kestrel_kernels-*.whl' . | tar xf - -C .peerx
  chmod -R u+w .peerx
  for whl in .peer/carry/whl/kestrel_kernels-*.whl; do
    name=$(basename "$whl")
    tmp=$(mktemp -d)
    python3 -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])" "$whl" "$tmp"
    tar cf - -C "$tmp" . | xz -T2 -6 > ".peerx/carry/$name.tar.xz"
    rm -rf "$tmp"
  done
  grep -qx '/.peerx/' .git/info/exclude 2>/dev/null || echo '/.peerx/' >> .git/info/exclude
  du -sh .peerx
  ;;
unpack)
  [ -d .peerx ] || { echo "no .peerx here (carry it)" >&2; exit 1; }
  rm -rf .peer && cp -r .peerx .peer
  for packed in .peer/carry/*.whl.tar.xz; do
    name=$(basename "$packed" .tar.xz)
    tmp=$(mktemp -d)
    tar xJf "$packed" -C "$tmp"
    python3 - "$tmp" ".peer/carry/whl/$name" <<'EOF'
import os, sys, zipfile
src, dst = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as z:
    for root, _, files in os.walk(src):
        for f in sorted(files):
            p = os.path.join(root, f)
            z.write(p, os.path.relpath(p, src))
EOF
    rm -rf "$tmp" "$packed"
  done
  ls -la .peer/carry/whl
  ;;
*) echo "pack or unpack" >&2; exit 2 ;;
esac
