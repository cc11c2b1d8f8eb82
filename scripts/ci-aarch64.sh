#!/usr/bin/env bash
# CI for aarch64: the library's unit tests and the `invariance`, `conformance` and `backward`
# integration tests, cross-compiled for aarch64-unknown-linux-gnu and run under qemu-user
# (the NEON path on an emulated CPU). Meant for Debian bookworm x86_64, run as root (or with sudo).
#
# Installs what is missing (Debian: gcc-aarch64-linux-gnu, libc6-dev-arm64-cross, qemu-user;
# rustup: the aarch64-unknown-linux-gnu target) and is a no-op for what is already there.
# Linker and runner come from environment variables, not a .cargo/config.toml, so ordinary
# builds are untouched; the target triple keeps the output apart under target/.
#
# Environment:
#   FA_AARCH64_PROPTEST_CASES  PROPTEST_CASES for the run (default below; bounds the time
#                              under emulation). Set it empty to use each test's own count.
#   FA_AARCH64_SKIP            space-separated test-name filters passed as `--skip` (default:
#                              none; every test, with PROPTEST_CASES bounding the random ones).
#   FA_AARCH64_SKIP_INSTALL=1  skip the install step (use what is on PATH).
#
# Measured on 2 cores (qemu 7.2): cold build ~50 s; tests with the defaults ~3 min.
set -euo pipefail
cd "$(dirname "$0")/.."

target=aarch64-unknown-linux-gnu
sysroot=/usr/aarch64-linux-gnu
cases="${FA_AARCH64_PROPTEST_CASES-16}"
skip="${FA_AARCH64_SKIP-}"

# --- install (only what is missing) -------------------------------------------------------------
if [ "${FA_AARCH64_SKIP_INSTALL:-0}" != 1 ]; then
    pkgs=(gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user)
    missing=()
    for p in "${pkgs[@]}"; do
        if [ "$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null)" != "install ok installed" ]; then
            missing+=("$p")
        fi
    done
    if [ ${#missing[@]} -gt 0 ]; then
        sudo=()
        if [ "$(id -u)" != 0 ]; then sudo=(sudo); fi
        echo "ci-aarch64: installing ${missing[*]}"
        "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive DEBCONF_NOWARNINGS=yes apt-get update -qq >/dev/null
        "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive DEBCONF_NOWARNINGS=yes apt-get install -y -qq \
            --no-install-recommends "${missing[@]}" >/dev/null
    fi
    if ! rustup target list --installed | grep -qx "$target"; then
        echo "ci-aarch64: rustup target add $target"
        rustup target add "$target" >/dev/null
    fi
fi

# --- build and test under qemu -------------------------------------------------------------------
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="qemu-aarch64 -L $sysroot"
# For any C code a build script might compile (the cc crate).
export CC_aarch64_unknown_linux_gnu=aarch64-linux-gnu-gcc
if [ -n "$cases" ]; then
    export PROPTEST_CASES="$cases"
fi

skip_args=()
for s in $skip; do skip_args+=(--skip "$s"); done

echo "=== aarch64 ($target) under qemu-user: flash-attn --lib + invariance, conformance, backward, kvcache;" \
    "PROPTEST_CASES=${PROPTEST_CASES:-<per-test default>}; skip: ${skip:-<none>} ==="
cargo test -p flash-attn --release --target "$target" \
    --lib --test invariance --test conformance --test backward --test kvcache --test ring -- "${skip_args[@]}"
