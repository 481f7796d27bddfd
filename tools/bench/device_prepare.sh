# Sourced by the device scripts (device_run.sh, reform_device.sh), from the repository root,
# with PY, RESULTS and a status() function set: makes a machine without MCCL installed able to
# run it. The 16-core accelerator machine brings no ip/tc/iperf3 (carry ../shared/device-fleet
# as .fleet-tools/), no pyzmq/zeroconf (carry their wheels in .whl/), torch, pybind11, cmake and
# ninja. Sets BUILD_OK=1 when the engine was built (or SKIP_BUILD=1 says it already is).

if [ -d .fleet-tools ]; then
  export LD_LIBRARY_PATH=$PWD/.fleet-tools/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  export PATH=$PWD/.fleet-tools/root/sbin:$PWD/.fleet-tools/root/bin:$PWD/.fleet-tools/root/usr/bin:$PATH
fi
{ uname -a; nproc; free -g; $PY --version; $PY -c 'import torch; print("torch", torch.__version__)';
  command -v ip tc iperf3; } > "$RESULTS/machine.txt" 2>&1

# --- wheels for mccld: only for modules that are missing (torch keeps its own numpy) --------
SITE=${SITE:-/tmp/mccl-site}
mkdir -p "$SITE"
export PYTHONPATH=$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}
if [ -d .whl ]; then
  # (The daemon links' AES-GCM is the libcrypto Python's hashlib uses: mccl_common/libcrypto.py.)
  for pkg_mod in pyzmq:zmq numpy:numpy ifaddr:ifaddr zeroconf:zeroconf; do
    pkg=${pkg_mod%%:*} mod=${pkg_mod#*:}
    if $PY -c "import $mod" 2>/dev/null; then continue; fi
    # pip picks the wheel that fits this Python, if .whl/ has one.
    if $PY -m pip install -q --no-index --no-deps --no-compile --find-links .whl --target "$SITE" "$pkg" \
         >> "$RESULTS/wheels.log" 2>&1 && $PY -c "import $mod" 2>> "$RESULTS/wheels.log"; then
      status "wheel $pkg installed into $SITE"
    else
      status "wheel $pkg not installed (see wheels.log)"
    fi
  done
fi

# --- the two entry points of pyproject.toml, without installing ------------------------------
# importlib.metadata finds this dist-info on sys.path (PYTHONPATH), so `import torch` registers
# the backend and torchrun finds the "mccl" rendezvous handler.
$PY - "$SITE" <<'PYEOF'
import sys, tomllib, pathlib
site = pathlib.Path(sys.argv[1])
proj = tomllib.load(open("pyproject.toml", "rb"))["project"]
d = site / f"{proj['name'].replace('-', '_')}-{proj['version']}.dist-info"
d.mkdir(parents=True, exist_ok=True)
(d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {proj['name']}\nVersion: {proj['version']}\n")
(d / "entry_points.txt").write_text("".join(
    f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()) + "\n"
    for group, eps in proj["entry-points"].items()))
PYEOF

# --- build the engine in place (no pip: _core.so lands next to libmccl/*.py) -------------
BUILD_OK=0
if [ "${SKIP_BUILD:-0}" = 1 ]; then
  status "build skipped (SKIP_BUILD=1)"
  BUILD_OK=1
else
  status "build start"
  PYBIND11_DIR=$($PY -c 'import pybind11; print(pybind11.get_cmake_dir())')
  # The engine links OpenSSL's libcrypto. A machine with the library but not its headers (the
  # accelerator machine's image may lack libssl-dev) builds against headers carried in
  # .openssl/include (Debian 12's libssl-dev, OpenSSL 3.0: ABI-stable across 3.x) and the
  # machine's own libcrypto.so.3.
  OSSL_ARGS=()
  if [ ! -f /usr/include/openssl/evp.h ] && [ -d .openssl/include ]; then
    CRYPTO=$(ls /usr/lib/x86_64-linux-gnu/libcrypto.so.3 /usr/lib64/libcrypto.so.3 /lib/x86_64-linux-gnu/libcrypto.so.3 \
             2>/dev/null | head -1)
    OSSL_ARGS=(-DOPENSSL_INCLUDE_DIR="$PWD/.openssl/include" -DOPENSSL_CRYPTO_LIBRARY="$CRYPTO")
    status "no OpenSSL headers here: building against .openssl/include and ${CRYPTO:-no libcrypto.so.3 found}"
  fi
  if timeout 90 cmake -S . -B build/device -G Ninja -DCMAKE_BUILD_TYPE=Release "${OSSL_ARGS[@]}" \
        -DPython_EXECUTABLE="$(command -v $PY)" -Dpybind11_DIR="$PYBIND11_DIR" > "$RESULTS/build.log" 2>&1 &&
     timeout 180 cmake --build build/device -j "$(nproc)" --target _core >> "$RESULTS/build.log" 2>&1; then
    cp build/device/_core*.so libmccl/
    status "build ok"
    BUILD_OK=1
  else
    status "build FAILED (see build.log)"
  fi
fi
