#!/usr/bin/env bash
# The CUDA paths in one command, on a machine whose python3 has torch and none of memtui's other
# dependencies (no network needed): `bash tests/gpu/run_on_device.sh` from the repository root,
# with the wheels `make gpu-wheels` gathered in .whl/ beside it.
#
#  1. installs the wheels into a private directory (SITE, default /tmp/site) on PYTHONPATH, with
#     the repository itself: the machine's own packages are left as they are;
#  2. runs tests/gpu (`pytest -m gpu`), its JUnit XML kept;
#  3. runs one client training on CUDA driven by the command line (tests/gpu/client_on_cuda.py:
#     the corpus's nanoGPT, its upstream files carried in tests/clients/upstream/).
#
# Everything it prints goes to OUT/gpu.log too (OUT: $OUT where set, else a new /tmp folder),
# beside gpu-junit.xml, client.json, client.log and status.txt. Each stage has its own time
# limit, under 8 minutes in all; the exit status is 0 only when every stage passed. Without a
# CUDA device the gpu tests skip, each with the reason, and it stops before the client (status
# 2); MEMTUI_GPU_TEST_DEVICE=cpu runs the client there all the same, a rehearsal (status 2 too).
set -uo pipefail

cd "$(dirname "$0")/../.." || exit 1
ROOT=$PWD
PYTHON=${PYTHON:-python3}
WHEELS=${WHEELS:-$ROOT/.whl}
SITE=${SITE:-/tmp/site}
OUT=${OUT:-$(mktemp -d /tmp/memtui-gpu.XXXXXX)}
INSTALL_LIMIT_S=${INSTALL_LIMIT_S:-30}
TESTS_LIMIT_S=${TESTS_LIMIT_S:-285}
CLIENT_LIMIT_S=${CLIENT_LIMIT_S:-100}
started=$SECONDS

stage() { echo "== $* ($((SECONDS - started)) s)"; }

main() {
    stage "machine (results in $OUT)"
    uname -srm
    "$PYTHON" --version
    command -v nvidia-smi >/dev/null && nvidia-smi -L

    stage "install the wheels from $WHEELS into $SITE"
    shopt -s nullglob
    wheels=("$WHEELS"/*.whl)
    if [ ${#wheels[@]} -eq 0 ]; then
        echo "no wheels in $WHEELS: run 'make gpu-wheels' where pip reaches PyPI, then carry .whl"
        exit 1
    fi
    rm -rf "$SITE"
    timeout "$INSTALL_LIMIT_S" "$PYTHON" -m pip install -q --no-index --no-deps --no-compile \
        --no-cache-dir --disable-pip-version-check --upgrade --target "$SITE" "${wheels[@]}" || {
        echo "the wheels did not install (${#wheels[@]} in $WHEELS)"
        exit 1
    }
    echo "${#wheels[@]} wheels installed"
    export PYTHONPATH="$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
    export PYTHONUNBUFFERED=1

    stage "what runs"
    # every runtime dependency imported, with the versions that run (the site's, not the machine's)
    "$PYTHON" - <<'EOF' || exit 1
import importlib.metadata as md

import torch

import memtui.cli, memtui.transport.client, memtui.hooks, memtui.runs.report, memtui.tui.app  # noqa: F401

names = ["textual", "pyzmq", "psutil", "nvidia-ml-py", "PyYAML", "click", "msgspec",
         "prometheus_client", "pytest", "pytest-timeout"]
print(" ".join(f"{n}=={md.version(n)}" for n in names))
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, "
      f"device: {torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none'}")
EOF
    cuda=$("$PYTHON" -c 'import torch; print(int(torch.cuda.is_available()))')

    stage "tests/gpu"
    # the machine's own pytest plugins stay out (built for another pytest than the site's); at
    # the limit SIGINT: pytest stops the test in flight (its training killed) and still writes
    # the JUnit XML of what ran
    PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 timeout -s INT -k 20 "$TESTS_LIMIT_S" \
        "$PYTHON" -m pytest -p pytest_timeout -q -rs -m gpu tests/gpu \
        --junitxml="$OUT/gpu-junit.xml"
    tests=$?
    echo "tests/gpu: exit status $tests"

    device=${MEMTUI_GPU_TEST_DEVICE:-cuda}
    if [ "$cuda" != 1 ]; then
        case $device in
            cuda*)
                stage "no CUDA device: the client needs one; stopping here"
                exit 2
                ;;
        esac
        echo "no CUDA device: the client rehearsed on $device (status 2 all the same)"
    fi

    stage "one client on $device"
    timeout -k 10 "$CLIENT_LIMIT_S" "$PYTHON" -m tests.gpu.client_on_cuda "$OUT"
    client=$?
    echo "client: exit status $client"

    stage "done: tests/gpu $tests, client $client"
    [ "$cuda" = 1 ] || exit 2
    [ "$tests" -eq 0 ] && [ "$client" -eq 0 ]
}

mkdir -p "$OUT"
main 2>&1 | tee "$OUT/gpu.log"
exit "${PIPESTATUS[0]}"
