# shellcheck shell=bash
# Source before running a development tool on the GPU machine, from any folder:
#
#   . hack/device/env.sh && python3 -m davit_tools.bench.gpu_suite --sections w1,w2
#
# That machine has torch, Triton and transformers but none of our distributions, so the tools
# run from the copied working tree's source folders, put first on PYTHONPATH: the contract and
# the engine (what the tools drive), the `davit` dispatcher (W3 starts `python -m davit_cli
# serve`, which inherits this path) and the tools themselves. The operator is left out: no GPU
# tool imports it.
_davit_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
export PYTHONPATH="$_davit_root/contract:$_davit_root/cli:$_davit_root/engine:$_davit_root/tools${PYTHONPATH:+:$PYTHONPATH}"
unset _davit_root
