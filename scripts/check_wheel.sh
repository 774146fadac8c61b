#!/usr/bin/env bash
# The package as a user installs it, without the checkout: builds the wheel, installs it into a fresh virtual
# environment, and from a directory outside the checkout runs `moe-jax train` (a short run), `moe-jax infer` with
# its adapter, `moe-jax chat`, and `moe-jax serve` answering a chat completion, all on the bundled default.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
work="$(mktemp -d)"
server=""
cleanup() {
  if [ -n "$server" ]; then kill "$server" 2>/dev/null || true; fi
  rm -rf "$work"
}
trap cleanup EXIT

python -m pip wheel -q --no-deps -w "$work/dist" "$root"
python -m venv "$work/venv"
"$work/venv/bin/pip" install -q "$work"/dist/moe_jax-*.whl
bin="$work/venv/bin"
cd "$work"

"$bin/moe-jax" train --max-steps 20 --no-progress --out run
"$bin/moe-jax" infer --adapter run/adapter --max-new-tokens 8 --out out.jsonl
test "$(wc -l < out.jsonl)" -gt 0
printf 'copy srel >\n' | "$bin/moe-jax" chat --temperature 0 --max-new-tokens 8 | grep -q .

port="$("$bin/python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
"$bin/moe-jax" serve --port "$port" > serve.log 2>&1 &
server=$!
"$bin/python" - "$port" <<'PY'
import json, sys, time, urllib.request

base = f"http://127.0.0.1:{sys.argv[1]}"
deadline = time.monotonic() + 300
while True:
    try:
        urllib.request.urlopen(base + "/health", timeout=5)
        break
    except OSError:
        if time.monotonic() > deadline:
            sys.exit("moe-jax serve did not come up in 300 s")
        time.sleep(1)
body = {"messages": [{"role": "user", "content": "copy srel >"}], "max_tokens": 8, "temperature": 0}
request = urllib.request.Request(
    base + "/v1/chat/completions", json.dumps(body).encode(), {"content-type": "application/json"}
)
answer = json.load(urllib.request.urlopen(request, timeout=120))
assert answer["choices"][0]["message"]["content"], answer
print("moe-jax serve answered:", repr(answer["choices"][0]["message"]["content"]))
PY
kill -TERM "$server"
status=0
wait "$server" || status=$?
server=""
if [ "$status" -ne 0 ] && [ "$status" -ne 143 ]; then  # 143: uvicorn ends by the SIGTERM it was sent, once shut down
  echo "moe-jax serve exited with $status after SIGTERM:" >&2
  cat serve.log >&2
  exit 1
fi
echo "the wheel works without the checkout"
