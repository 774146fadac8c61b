"""Generation and serving over expert shards (generation/lockstep.py): 2 and 4 local processes, each holding 1/N
of every layer's experts, give one process's greedy, sampled (same seeds) and speculative generations token for
token, on the bundled model and tiny deepseek_v3 / qwen3_moe checkpoints, in float32 and int4; each process holds
1/N of the expert bytes; the server over 2 processes answers as offline generation does (per-request adapters
too), reports each process's host busy time, and when process 1 is killed mid-stream ends the stream with an error
and exits non-zero."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import openai
import pytest

import moe_jax
from moe_jax import infer, process_links, serve
from moe_jax.errors import InputError
from moe_jax.generation import lockstep
from moe_jax.native import process_sum
from moe_jax.serving.process import running_server
from tests.hf_models import make_hf_model, save_hf_model
from tests.test_distributed import finished, launch, process_of
from tests.test_serve import chat_tokens
from tests.test_train import MODEL, ROOT

RUNNER = ROOT / "tests" / "expert_parallel_generation_run.py"
CASES = {  # id: (processes, model, quant)
    "bench-float32-2": (2, "bench", None),
    "deepseek_v3-int4-2": (2, "deepseek_v3", "int4"),
    "qwen3_moe-float32-4": (4, "qwen3_moe", None),
    "bench-int4-4": (4, "bench", "int4"),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    made = {"bench": MODEL}
    for family in ("deepseek_v3", "qwen3_moe"):
        made[family] = save_hf_model(make_hf_model(family, seed=3), tmp_path_factory.mktemp(family))
    return made


def run(out, model, quant, processes: int = 1) -> dict:
    command = [RUNNER, out, model, *([quant] if quant else [])]
    if processes == 1:
        done = subprocess.run([sys.executable, *map(str, command)], cwd=ROOT, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
    else:
        finished(launch(processes, *command))
    return json.loads(out.read_text())


@pytest.mark.parametrize("case", CASES)
def test_expert_shards_generate_one_process_tokens(case, checkpoints, tmp_path):
    processes, name, quant = CASES[case]
    one = run(tmp_path / "one.json", checkpoints[name], quant)
    many = run(tmp_path / "many.json", checkpoints[name], quant, processes)
    for kind in ("greedy", "sampled", "speculative"):
        assert many[kind] == one[kind], kind
    assert len(set(many["sums"])) == 1 and many["sums"][0] > 0  # every process made each sum
    # routed: only the rows of a process's experts' tokens travel (a bench-model token's 2 of 4 experts are both
    # in the other half for 1 in 6 tokens), and never more bytes than every row
    assert all(0 < sent <= dense for sent, dense in many["sent"]), many["sent"]
    if name == "bench":
        assert sum(s for s, _ in many["sent"]) < sum(d for _, d in many["sent"])
    whole = one["store_bytes"][0]
    assert many["store_bytes"] == pytest.approx([whole / processes] * processes, rel=0.02)


def test_the_python_sum_adds_as_the_native_one(monkeypatch):
    """Where the native handler is not built, a callback sums over the same links in the same order: checked here
    over a socket pair standing in for two processes, against float32 sums in process order."""
    a, b = socket.socketpair()
    world0, world1 = moe_jax.distributed.World(0, 2), moe_jax.distributed.World(1, 2)
    links0 = process_links.Links(world0, [None, a])
    links1 = process_links.Links(world1, [b, None])
    rng = np.random.default_rng(0)
    x0, x1 = (rng.normal(size=(3, 700)).astype(np.float32) for _ in range(2))
    got = {}
    other = threading.Thread(target=lambda: got.update(one=process_links.python_sum(links1, x1)))
    other.start()
    got["zero"] = process_links.python_sum(links0, x0)
    other.join(10)
    np.testing.assert_array_equal(got["zero"], x0 + x1)
    np.testing.assert_array_equal(got["one"], got["zero"])
    b.close()  # process 1 gone
    with pytest.raises(moe_jax.distributed.PeerFailed, match="process 1 of 2: the link closed"):
        process_links.python_sum(links0, x0)
    a.close()


@pytest.mark.parametrize("command", [infer, serve])
def test_the_expert_shards_flag_is_checked(command):
    with pytest.raises(InputError, match="--expert-shards must be >= 1, got 0"):
        command.main(["--expert-shards", "0"])


def test_a_sharded_model_needs_its_processes_in_step():
    with pytest.raises(moe_jax.errors.ConfigError, match="expert_shards 2 must equal the run's process count"):
        moe_jax.distributed.this_process_shard(2)
    assert lockstep.run(moe_jax.load_model(MODEL), lambda: "alone") == "alone"  # not sharded: the body alone
    assert process_sum._links is None


def test_the_server_over_two_processes_answers_as_offline_and_ends_when_one_dies(bundled_adapters, tmp_path):
    prompts = ["sort dcba >", "copy hello >", "reverse abc >"]
    wanted = {}  # (served model name, prompt): offline generation's answer, the adapter loaded
    for name, adapter in (("tiny-moe", None), *bundled_adapters.items()):
        offline = moe_jax.load_model(MODEL, adapter=adapter)
        for p in prompts:
            wanted[name, p] = offline.tokenizer.decode(
                offline.generate([chat_tokens(offline, p)], max_new_tokens=10)[0]
            )
    assert len(set(wanted.values())) > len(prompts)  # the adapters change the answers
    log = tmp_path / "server.log"
    modules = [f"{name}={path}" for name, path in bundled_adapters.items()]
    arguments = ["--model", str(MODEL), "--expert-shards", "2", "--max-batch", "4", "--lora-modules", *modules]
    with running_server(arguments, log, 2) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)

        def answer(served: str, prompt: str) -> str:
            return (
                client.chat.completions.create(
                    model=served, messages=[{"role": "user", "content": prompt}], max_tokens=10, temperature=0
                )
                .choices[0]
                .message.content
            )

        with ThreadPoolExecutor(len(wanted)) as pool:  # concurrent: rows of different adapters share the batch
            answers = dict(zip(wanted, pool.map(lambda key: answer(*key), wanted), strict=True))
        assert answers == wanted
        for _ in range(12):  # /metrics reads the processes' figures every 16 steps
            client.completions.create(model="tiny-moe", prompt="sort cba >", max_tokens=8, temperature=0)
        busy = {k: v for k, v in server.metrics().items() if k.startswith("moe_jax_process_host_busy_seconds")}
        assert len(busy) == 2 and all(v > 0 for v in busy.values()), busy

        stream = client.completions.create(
            model="tiny-moe", prompt="copy a >", max_tokens=100, temperature=0.9, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        pieces, error = [], None
        try:
            for i, chunk in enumerate(stream):
                pieces.append(chunk.choices[0].text)
                if i == 2:
                    os.kill(process_of(server.process.pid, 1), signal.SIGKILL)
                    killed_at = time.monotonic()
        except openai.APIError as e:
            error = e
        assert error is not None and "process 1 of 2" in str(error), (error, pieces)
        assert len(pieces) < 100
        server.process.wait(60)
        assert time.monotonic() - killed_at < 60
        assert server.process.returncode != 0, log.read_text()
