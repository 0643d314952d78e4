#!/usr/bin/env bash
# Mutation testing of one module against its own tests, with mutmut 3 (docs/reliability.md).
#
#   .ci/mutate.sh MODULE.py [MUTANT_GLOB...] -- PYTEST_ARGS...
#
#   .ci/mutate.sh jaxserve/runtime/roofline.py -- tests/unit/test_roofline.py
#   .ci/mutate.sh jaxserve/runtime/kv_transfer.py \
#       'jaxserve.runtime.kv_transfer.x_default_host_bytes*' -- tests/unit/test_kv_transfer.py
#
# mutmut reads its settings from the repository root and writes mutants/ there, so the run
# happens in a scratch copy of the working tree (tracked and untracked, not ignored files):
# $MUTATE_DIR (default /tmp/jaxserve-mutate/<module>), where setup.cfg names the one module to
# mutate and the tests to run. Nothing is written to the checkout. Needs mutmut in the Python
# of $PYTHON's folder (default: the one on PATH): `pip install mutmut`. Prints mutmut's results
# (survivors and timeouts by name) and a total/killed/survived/timeout line; `mutmut show NAME`
# in $MUTATE_DIR shows a mutant's diff. MUTATE_RESUME=1 goes on with a run that was stopped
# (the same $MUTATE_DIR, its copy and results kept, tests/ copied again). MUTATE_JOBS (default
# 2) mutants at a time; MUTATE_ISOLATION=fork is faster where the tests start no gRPC server.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
module="${1:?usage: .ci/mutate.sh MODULE.py [MUTANT_GLOB...] -- PYTEST_ARGS...}"
shift
glob=()
while [[ $# -gt 0 && "$1" != "--" ]]; do glob+=("$1"); shift; done
[[ "${1:-}" == "--" ]] && shift
[[ $# -gt 0 ]] || { echo "mutate: name the tests to run after --" >&2; exit 2; }
[[ -f "$root/$module" ]] || { echo "mutate: no module $module" >&2; exit 2; }
python="${PYTHON:-python}"
bin="$(dirname "$(command -v "$python")")"
[[ -x "$bin/mutmut" ]] || { echo "mutate: no mutmut beside $python (pip install mutmut)" >&2; exit 2; }

dir="${MUTATE_DIR:-/tmp/jaxserve-mutate/$(echo "${module%.py}" | tr / .)}"
if [[ "${MUTATE_RESUME:-0}" == 1 && -f "$dir/setup.cfg" ]]; then
    echo "mutate: resuming in $dir (mutants already run are not run again)"
    # Tests written since count (mutmut copies tests/ on every run): name survivors as
    # MUTANT_GLOBs to run them again against them.
    (cd "$root" && git ls-files -z --cached --others --exclude-standard tests | tar -c --null -T -) |
        tar -x -C "$dir"
else
    rm -rf "$dir" && mkdir -p "$dir"
    (cd "$root" && git ls-files -z --cached --others --exclude-standard | tar -c --null -T - 2>/dev/null) |
        tar -x -C "$dir"
    {
        echo "[mutmut]"
        echo "source_paths ="
        for p in jaxserve service pallas_kernels checkpoints; do echo "    $p"; done
        echo "only_mutate = $module"
        # fork (mutmut's default) forks each mutant from a process that ran the tests: quick, but
        # a test that started a gRPC server leaves threads that deadlock the child (every mutant
        # times out); forkserver forks from a clean process instead.
        echo "process_isolation = ${MUTATE_ISOLATION:-forkserver}"
        # A mutant's time limit is 15 x its tests' calls + this: module fixtures (an engine to
        # compile, a server to start) are not in the calls' times, and take seconds.
        echo "timeout_constant = ${MUTATE_TIMEOUT_S:-60}"
        printf 'pytest_add_cli_args =\n    -p\n    no:cacheprovider\n    -q\n'
        echo "pytest_add_cli_args_test_selection ="
        for a in "$@"; do echo "    $a"; done
    } >"$dir/setup.cfg"
fi

cd "$dir"
export PATH="$bin:$PATH"
"$bin/mutmut" run --max-children "${MUTATE_JOBS:-2}" "${glob[@]}" >mutmut-run.log 2>&1 ||
    { tail -40 mutmut-run.log; exit 1; }
"$bin/mutmut" results --all true >results.txt 2>&1
# The tally of the mutants run (those of the MUTANT_GLOBs if any were given): mutmut's own stats
# count every mutant of the file, run or not.
MUTANT_GLOBS="${glob[*]:-*}" "$python" - <<'EOF'
import collections, fnmatch, os
globs = os.environ["MUTANT_GLOBS"].split()
rows = [line.strip().rsplit(": ", 1) for line in open("results.txt") if ": " in line]
rows = [(name, status) for name, status in rows if any(fnmatch.fnmatch(name, g) for g in globs)]
n = collections.Counter(status for name, status in rows)
for name, status in rows:
    if status != "killed":
        print(f"    {name}: {status}")
done = n["killed"] + n["survived"] + n["timeout"]
other = {k: v for k, v in n.items() if k not in ("killed", "survived", "timeout")}
print(f"mutate: total {sum(n.values())}, killed {n['killed']}, survived {n['survived']}, "
      f"timeout {n['timeout']}" + (f", other {other}" if other else "")
      + (f"; kill rate {(n['killed'] + n['timeout']) / done:.0%}" if done else ""))
EOF
echo "mutate: in $dir"
