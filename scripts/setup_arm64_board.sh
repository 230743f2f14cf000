#!/usr/bin/env bash
# Set up an emulated 64-bit Arm edge board on this x86_64 machine, for `deploy` tests.
#
#   scripts/setup_arm64_board.sh [--cache DIR]
#
# What it builds (once; later runs reuse the cache and only re-check it, in a few seconds):
#   DIR/root/      Debian bookworm arm64 userland with python3.11 (.debs unpacked with dpkg -x)
#   DIR/site/      PyPI aarch64 wheels: apache-tvm (compiler library deleted: runtime only),
#                  apache-tvm-ffi, numpy, ml_dtypes, typing_extensions, cloudpickle, psutil
#   DIR/bin/python3  an x86 wrapper that runs the board's Python under qemu-aarch64-static
#                  (no binfmt_misc needed), with TVM_USE_RUNTIME_LIB=1 and DIR/site appended
#                  to PYTHONPATH (a caller's PYTHONPATH comes first, as with any python3)
#   DIR/board.json what tvm_layerfuse.board reads to start the board's RPC server
#
# DIR defaults to $TVM_LAYERFUSE_ARM64_BOARD or ~/.cache/tvm_layerfuse/arm64-board.
# Host packages (apt): qemu-user-static, gcc-aarch64-linux-gnu (the cross linker that
# `compile --target aarch64` uses). Needs root (or sudo) only for that apt-get install.
# PYTHON (default python3) is the host Python whose pip downloads the wheels.
set -euo pipefail

CACHE="${TVM_LAYERFUSE_ARM64_BOARD:-$HOME/.cache/tvm_layerfuse/arm64-board}"
while [ $# -gt 0 ]; do
  case "$1" in
    --cache) CACHE="$2"; shift 2 ;;
    --cache=*) CACHE="${1#--cache=}"; shift ;;
    -h|--help) sed -n '2,19p' "$0"; exit 0 ;;
    *) echo "error: unknown option $1; expected --cache DIR" >&2; exit 2 ;;
  esac
done
PYTHON="${PYTHON:-python3}"

# The board's software. Versions are pinned so that every run builds the same board.
DEBS="python3.11-minimal libpython3.11-minimal libpython3.11-stdlib libc6 libexpat1 zlib1g libffi8
libssl3 libbz2-1.0 liblzma5 libsqlite3-0 libtinfo6 libncursesw6 libreadline8 libuuid1 libgcc-s1
libstdc++6 libcrypt1 libdb5.3 libgdbm6 libnsl2 libtirpc3"
WHEELS="apache-tvm==0.27.0.post1 apache-tvm-ffi==0.1.14.post1 numpy==2.4.6 ml_dtypes==0.6.0
typing_extensions==4.16.0 cloudpickle==3.1.3 psutil==7.2.2"

say() { echo "setup_arm64_board: $*" >&2; }
die() { echo "error: $*" >&2; exit 1; }
stamp_ok() { [ -f "$1" ] && [ "$(cat "$1")" = "$2" ]; }

mkdir -p "$CACHE"
CACHE="$(cd "$CACHE" && pwd)"
ROOT="$CACHE/root"
SITE="$CACHE/site"
say "board cache: $CACHE"

# ---------------------------------------------------------------- host tools
need=()
command -v qemu-aarch64-static >/dev/null 2>&1 || need+=(qemu-user-static)
command -v aarch64-linux-gnu-gcc >/dev/null 2>&1 || need+=(gcc-aarch64-linux-gnu)
if [ ${#need[@]} -gt 0 ]; then
  SUDO=""
  if [ "$(id -u)" != 0 ]; then
    command -v sudo >/dev/null 2>&1 || die "missing ${need[*]}; install them as root: apt-get install ${need[*]}"
    SUDO="sudo"
  fi
  say "installing ${need[*]} (apt-get)"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}" >/dev/null
fi
QEMU="$(command -v qemu-aarch64-static)"

# ---------------------------------------------------------------- arm64 debs -> root/
# An apt configuration of its own (lists, caches, status) so the host's apt is never touched.
deb_sig="$(echo $DEBS)"
if ! stamp_ok "$ROOT/.complete" "$deb_sig"; then
  APT="$CACHE/apt"
  mkdir -p "$APT/lists/partial" "$APT/cache/archives/partial" "$APT/debs"
  : > "$APT/status"
  apt_opts=(-q -oAPT::Architecture=arm64 -oAPT::Architectures=arm64 "-oDir::State::Lists=$APT/lists"
            "-oDir::State::status=$APT/status" "-oDir::Cache=$APT/cache" -oDebug::NoLocking=1)
  [ "$(id -u)" = 0 ] && apt_opts+=(-oAPT::Sandbox::User=root)
  say "fetching arm64 package lists"
  apt-get "${apt_opts[@]}" update >/dev/null
  say "downloading arm64 python3.11 .debs"
  (cd "$APT/debs" && rm -f ./*.deb && apt-get "${apt_opts[@]}" download $DEBS >/dev/null)
  rm -rf "$ROOT.tmp"
  mkdir -p "$ROOT.tmp"
  for deb in "$APT/debs"/*.deb; do dpkg -x "$deb" "$ROOT.tmp"; done
  [ -x "$ROOT.tmp/usr/bin/python3.11" ] || die "the arm64 debs did not contain usr/bin/python3.11"
  echo "$deb_sig" > "$ROOT.tmp/.complete"
  rm -rf "$ROOT"
  mv "$ROOT.tmp" "$ROOT"
fi

# ---------------------------------------------------------------- aarch64 wheels -> site/
wheel_sig="$(echo $WHEELS)"
if ! stamp_ok "$SITE/.complete" "$wheel_sig"; then
  mkdir -p "$CACHE/wheels"
  say "downloading aarch64 wheels (pip)"
  "$PYTHON" -m pip download -q --dest "$CACHE/wheels" --platform manylinux_2_28_aarch64 \
    --python-version 3.11 --only-binary=:all: --no-deps $WHEELS
  rm -rf "$SITE.tmp"
  mkdir -p "$SITE.tmp"
  for spec in $WHEELS; do
    name="${spec%%==*}"; version="${spec#*==}"
    pattern="$(echo "$name" | tr '-' '_')-$version-"
    wheel="$(ls "$CACHE/wheels" | grep -i -E "^$pattern.*(aarch64|none-any)\.whl$" | head -n 1 || true)"
    [ -n "$wheel" ] || die "no aarch64 wheel for $spec in $CACHE/wheels; pip download did not fetch it"
    "$PYTHON" -m zipfile -e "$CACHE/wheels/$wheel" "$SITE.tmp"
  done
  # Runtime only: the board never compiles (this is what a real board gets from `bundle`).
  rm -f "$SITE.tmp/tvm/lib/libtvm_compiler.so"
  [ -f "$SITE.tmp/tvm/lib/libtvm_runtime.so" ] || die "the apache-tvm wheel has no tvm/lib/libtvm_runtime.so"
  echo "$wheel_sig" > "$SITE.tmp/.complete"
  rm -rf "$SITE"
  mv "$SITE.tmp" "$SITE"
fi

# ---------------------------------------------------------------- the board's python
mkdir -p "$CACHE/bin"
WRAPPER="$CACHE/bin/python3"
WRAPPER_TMP="$(mktemp "$WRAPPER.XXXXXX")"  # its own file: set-ups running at once each rename a whole one
cat > "$WRAPPER_TMP" <<EOF
#!/bin/sh
# The emulated AArch64 board's Python (written by scripts/setup_arm64_board.sh).
# An x86 script, so that sys.executable can point at it: TVM's RPC server re-executes
# sys.executable, and without binfmt_misc the kernel cannot exec an AArch64 binary.
# PYTHONPATH given by the caller (e.g. a bundle's site/) comes before the board's own site.
export TVM_USE_RUNTIME_LIB=1
export PYTHONPATH="\${PYTHONPATH:+\$PYTHONPATH:}$SITE"
export PYTHONNOUSERSITE=1
exec "$QEMU" -L "$ROOT" "$ROOT/usr/bin/python3.11" "\$@"
EOF
chmod 755 "$WRAPPER_TMP"
mv "$WRAPPER_TMP" "$WRAPPER"

# ---------------------------------------------------------------- verify: runtime-only tvm on aarch64
say "checking the board's python (import tvm under qemu)"
report="$(env -u PYTHONPATH "$WRAPPER" -c '
import json, platform, sys
import tvm, tvm_ffi, numpy
from tvm import rpc  # noqa: F401  (the RPC server needs it)
from tvm.runtime import vm  # noqa: F401
import cloudpickle, psutil  # noqa: F401
compiler = tvm.get_global_func("relax.build", allow_missing=True) is not None
print(json.dumps({"machine": platform.machine(), "python": platform.python_version(),
                  "tvm": tvm.__version__, "tvm_ffi": tvm_ffi.__version__, "numpy": numpy.__version__,
                  "compiler": compiler}))
')" || die "the board's python cannot import tvm; remove $CACHE and run this script again"
echo "$report" | "$PYTHON" -c '
import json, sys
r = json.loads(sys.stdin.read())
if r["machine"] != "aarch64":
    sys.exit("error: the board python reports machine " + r["machine"] + "; expected aarch64")
if r["compiler"]:
    sys.exit("error: the board tvm still has its compiler; expected a runtime-only tree")
'

"$PYTHON" - "$CACHE" "$report" <<'EOF'
import json, os, sys, tempfile
cache, report = sys.argv[1], json.loads(sys.argv[2])
board = {
    "format": "tvm_layerfuse.arm64-board", "version": 2, "machine": "aarch64",
    "python": os.path.join(cache, "bin", "python3"), "root": os.path.join(cache, "root"),
    "site": os.path.join(cache, "site"), "versions": report,
}
fd, tmp = tempfile.mkstemp(dir=cache, prefix=".board.json.")
with os.fdopen(fd, "w") as f:
    json.dump(board, f, indent=1)
os.replace(tmp, os.path.join(cache, "board.json"))
EOF
say "ready: python $WRAPPER (aarch64, tvm $(echo "$report" | "$PYTHON" -c 'import json,sys; print(json.load(sys.stdin)["tvm"])'), runtime only)"
echo "$CACHE"
