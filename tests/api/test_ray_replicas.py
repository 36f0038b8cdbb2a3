"""`folio serve --replicas 2` on Ray Serve, met as a user meets it: the CLI starts a local Ray instance,
two engine replicas and the ingress; the official openai client talks to it.

One Ray instance for the module (starting one costs ~15 s here); the last test stops it with SIGTERM.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from collections import Counter

import anthropic
import httpx
import ollama
import openai
import psutil
import pytest
from ray.cluster_utils import Cluster

from folio import LLM, SamplingParams
from tests.api.ray_server import KEY, RayServer, stop_ray_server
from tests.api.server_runner import MODEL
from tests.api.tool_examples import HISTORY as TOOL_HISTORY
from tests.api.tool_examples import TOOLS

TENANT_A = "You are the support assistant of a bakery. Answer in one short sentence about bread. " * 4
TENANT_B = "You are a travel agent who only talks about trains across the Alps and their timetables. " * 4


@pytest.fixture(scope="module")
def ray_server():
    server = RayServer()
    try:
        server.wait_ready(timeout=240)
        yield server
    finally:
        stop_ray_server(server)


@pytest.fixture(scope="module")
def ray_client(ray_server):
    return openai.OpenAI(base_url=f"{ray_server.url}/v1", api_key=KEY, max_retries=0, timeout=120)


def _per_replica(before: Counter, after: Counter) -> dict[str, int]:
    delta: Counter = Counter()
    for (replica, _), value in after.items():
        delta[replica] += value - before.get((replica, _), 0)
    return {replica: count for replica, count in delta.items() if count}


def test_outputs_equal_folio_serve(ray_client, client):
    """The same greedy answers as the single-engine server, whole and streamed, completions and chat."""
    for prompt in ["The capital of France is", "def fibonacci(n):", TENANT_A + "What is sourdough?"]:
        ours = ray_client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
        theirs = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
        assert ours.choices[0].text == theirs.choices[0].text
        assert ours.usage.prompt_tokens == theirs.usage.prompt_tokens
    messages = [{"role": "user", "content": "Name three colours."}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
    stream = ray_client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0,
                                                stream=True)  # fmt: skip
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == whole.choices[0].message.content
    seeded = dict(model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=0.9, seed=7, n=2)
    ours = ray_client.completions.create(**seeded)
    theirs = client.completions.create(**seeded)
    assert [c.text for c in ours.choices] == [c.text for c in theirs.choices]


def test_embeddings_equal_folio_serve(ray_client, client):
    """An embedding job crosses to a replica like any other (its parameters carry the pooling) and its
    vector comes back in the update."""
    texts = ["The capital of France is", "Hello there"]
    ours = ray_client.embeddings.create(model=MODEL, input=texts, dimensions=32)
    theirs = client.embeddings.create(model=MODEL, input=texts, dimensions=32)
    for a, b in zip(ours.data, theirs.data, strict=True):
        assert len(a.embedding) == 32 and a.embedding == pytest.approx(b.embedding, abs=1e-5)
    assert ours.usage.prompt_tokens == theirs.usage.prompt_tokens


def test_shared_prefixes_stay_on_one_replica(ray_server, ray_client):
    """Each tenant's requests go to one replica, the two tenants to different replicas, and the
    repeats hit that replica's prefix cache."""
    homes = []
    for system in (TENANT_A, TENANT_B):
        before = ray_server.routed()
        for question in ("Question one?", "Question two, a little longer?", "Three?"):
            messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
            ray_client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
        after = ray_server.routed()
        per_replica = _per_replica(before, after)
        assert list(per_replica.values()) == [3], per_replica
        homes.append(next(iter(per_replica)))
        home = homes[-1]
        assert after[(home, "prefix")] - before.get((home, "prefix"), 0) == 2
    assert homes[0] != homes[1]
    deadline = time.monotonic() + 15  # replicas post their metrics every second
    hits: dict[str, float] = {}
    while time.monotonic() < deadline:
        hits = ray_server.per_replica("folio:prefix_cache_hits_total")
        if all(hits.get(home, 0) >= 2 * 64 for home in homes):  # two repeats of a >64-token prefix each
            break
        time.sleep(0.5)
    else:
        raise AssertionError(f"prefix-cache hits per replica: {hits}")


def test_every_api_answers_through_the_replicas(ray_server, ray_client, client):
    """The Ollama, Anthropic and Responses routes and tool calls ride the same RemoteEngine: the answers
    are the single-engine server's."""
    messages = [{"role": "user", "content": "Name three colours."}]
    expected = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    text = expected.choices[0].message.content
    olla = ollama.Client(host=ray_server.url, headers={"Authorization": f"Bearer {KEY}"})
    assert (
        olla.chat(model=MODEL, messages=messages, options={"temperature": 0, "num_predict": 12}).message.content == text
    )
    claude = anthropic.Anthropic(base_url=ray_server.url, api_key=KEY, max_retries=0)
    reply = claude.messages.create(model=MODEL, max_tokens=12, messages=messages, extra_body={"temperature": 0})
    assert reply.content[0].text == text
    assert (
        ray_client.responses.create(model=MODEL, input=messages, max_output_tokens=12, temperature=0).output_text
        == text
    )
    ask = {"model": MODEL, "messages": [*TOOL_HISTORY, {"role": "user", "content": "What is the weather in Paris?"}],
           "tools": TOOLS, "temperature": 0, "max_tokens": 60}  # fmt: skip
    ours, theirs = ray_client.chat.completions.create(**ask), client.chat.completions.create(**ask)
    assert [(c.function.name, c.function.arguments) for c in ours.choices[0].message.tool_calls] == [
        (c.function.name, c.function.arguments) for c in theirs.choices[0].message.tool_calls]  # fmt: skip


def test_errors_auth_and_health(ray_server, ray_client):
    with pytest.raises(openai.BadRequestError) as bad:
        ray_client.completions.create(model=MODEL, prompt="x", temperature=-1)
    assert bad.value.body["param"] == "temperature"
    anonymous = httpx.post(f"{ray_server.url}/v1/completions", json={"model": MODEL, "prompt": "x"}, timeout=10)
    assert anonymous.status_code == 401 and anonymous.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{ray_server.url}/health", timeout=10).json() == {"status": "ok"}
    with pytest.raises(openai.NotFoundError):
        ray_client.completions.create(model="another-model", prompt="x")
    too_long = " ".join(["word"] * 5000)  # the replicas hold 256 x 16 tokens
    with pytest.raises(openai.BadRequestError, match="context length"):
        ray_client.completions.create(model=MODEL, prompt=too_long, max_tokens=4)
    text = ray_server.metrics()
    assert re.search(r'folio:num_requests_admitted\{model_name="smollm2-135m"\} 0\.0', text)
    assert len(ray_server.per_replica("folio:generation_tokens_total")) == 2


def test_a_killed_replica_is_survived(ray_server, ray_client):
    """SIGKILL the replica running one stream: that stream ends with a clean error, the stream on the
    other replica runs to its end, later requests are answered, and Ray starts a new replica."""
    replicas = ray_server.replicas()

    class Stream(threading.Thread):
        def __init__(self, prompt: str) -> None:
            super().__init__()
            self.prompt, self.started, self.chunks, self.failure = prompt, threading.Event(), [], []

        def run(self) -> None:
            try:
                stream = ray_client.completions.create(
                    model=MODEL, prompt=self.prompt, max_tokens=160, temperature=0, stream=True,
                    extra_body={"ignore_eos": True},
                )  # fmt: skip
                for chunk in stream:
                    self.chunks.append(chunk)
                    self.started.set()
            except openai.APIError as exc:
                self.failure.append(exc)
            finally:
                self.started.set()

    placed = []
    for prompt in ("Zebras and zeppelins: a list of facts.", "Quantum quokkas, chapter one."):  # no recorded prefix
        before = ray_server.routed()
        stream = Stream(prompt)
        stream.start()
        assert stream.started.wait(60) and not stream.failure
        placed.append((stream, next(iter(_per_replica(before, ray_server.routed())))))
    (doomed, victim), (spared, survivor) = placed
    assert victim != survivor  # the second went to the idle replica
    os.kill(replicas[victim], signal.SIGKILL)
    for stream in (doomed, spared):
        stream.join(timeout=120)
        assert not stream.is_alive()
    assert doomed.failure and "replica" in str(doomed.failure[0]), doomed.failure
    assert not spared.failure and spared.chunks[-1].choices[0].finish_reason == "length"
    assert sum(len(c.choices[0].text) > 0 for c in spared.chunks) >= 150
    for _ in range(4):  # answered, by the survivor or by a replacement
        answer = ray_client.completions.create(model=MODEL, prompt="Bread?", max_tokens=8, temperature=0,
                                               extra_body={"ignore_eos": True})  # fmt: skip
        assert answer.choices[0].finish_reason == "length"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        now = ray_server.replicas()
        if len(now) == 2 and victim not in now and survivor in now:
            break
        time.sleep(1)
    else:
        raise AssertionError(f"Ray did not replace the killed replica: {ray_server.replicas()}")


def test_sigterm_stops_ray_and_every_replica(ray_server):
    pids = set(ray_server.replicas().values())
    ray_server.process.send_signal(signal.SIGTERM)
    assert ray_server.process.wait(timeout=90) == 0, ray_server.output()[-4000:]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        left = [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]
        raylets = [p for p in psutil.process_iter(["name", "cmdline"])
                   if p.info["name"] == "raylet" or "ray::" in " ".join(p.info["cmdline"] or [])]  # fmt: skip
        if not left and not raylets:
            return
        time.sleep(0.5)
    raise AssertionError(f"left running: replicas {left}, raylets {raylets}")


def test_autoscaling_adds_a_replica_under_load():
    """Ray Serve's autoscaler, bounded by --min/--max-replicas, adds the second replica when the requests
    in flight exceed the target. Runs after the shared server stopped: one Ray instance at a time."""
    server = RayServer("--min-replicas", "1", "--max-replicas", "2", "--autoscale-target", "1")
    try:
        server.wait_ready(timeout=240, replicas=1)
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=300)
        scaled = threading.Event()

        def busy() -> None:
            # Streamed, so that the load hangs up (and the server aborts it) once the replica is there.
            with client.completions.create(model=MODEL, prompt="Count slowly:", max_tokens=300, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True}) as stream:  # fmt: skip
                for _ in stream:
                    if scaled.is_set():
                        return

        load = [threading.Thread(target=busy) for _ in range(6)]
        for thread in load:
            thread.start()
        deadline = time.monotonic() + 120
        while len(server.replicas()) < 2:
            assert time.monotonic() < deadline, f"no second replica: {server.replicas()}"
            time.sleep(1)
        scaled.set()
        for thread in load:
            thread.join(timeout=300)
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(timeout=90) == 0
    finally:
        stop_ray_server(server)


def test_disaggregated_prefill_and_decode(client):
    """--disaggregate: a prefill replica computes each prompt and hands its KV blocks to the decode
    replica. The answers are folio serve's (greedy and seeded), the blocks crossed, both pools end empty,
    and a prefill replica killed mid-prompt costs only time: the decode replica computes it itself."""
    server = RayServer("--disaggregate", "--prefill-replicas", "1", "--replicas", "1")
    try:
        server.wait_ready(timeout=240, replicas=1, role="decode")
        server.wait_ready(timeout=60, replicas=1, role="prefill")
        ray_client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=300)
        for prompt in (TENANT_A + "What is rye bread?", TENANT_B + "Which pass is the highest?"):
            ours = ray_client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
            theirs = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
            assert ours.choices[0].text == theirs.choices[0].text
        seeded = dict(model=MODEL, prompt=TENANT_A + "Tell a story.", max_tokens=16, temperature=0.9, seed=3, n=2)
        assert [c.text for c in ray_client.completions.create(**seeded).choices] == [
            c.text for c in client.completions.create(**seeded).choices
        ]
        _wait_for_metric(server, lambda: sum(server.per_replica("folio:kv_transfer_blocks_total").values()) >= 8)

        prefill_pid = next(iter(server.replicas("prefill").values()))
        long_prompt = "Inventory: " + ", ".join(f"crate {i} of apples" for i in range(250)) + ". Total?"
        answers: list = []
        asking = threading.Thread(target=lambda: answers.append(ray_client.completions.create(
            model=MODEL, prompt=long_prompt, max_tokens=8, temperature=0)))  # fmt: skip
        asking.start()
        time.sleep(1.5)  # the prefill replica (one CPU) is computing the ~2,200-token prompt: seconds
        os.kill(prefill_pid, signal.SIGKILL)
        asking.join(timeout=240)
        expected = client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=8, temperature=0)
        assert answers and answers[0].choices[0].text == expected.choices[0].text
        _wait_for_metric(server, lambda: sum(server.per_replica("folio:kv_transfer_fallbacks_total").values()) >= 1)
        # Nothing left allocated: every replica's pool is free once the requests are done.
        _wait_for_metric(server, lambda: all(v == 0 for v in server.per_replica("folio:kv_cache_usage_ratio").values()))
        deadline = time.monotonic() + 180
        while prefill_pid in server.replicas("prefill").values() or not server.replicas("prefill"):
            assert time.monotonic() < deadline, "Ray did not replace the prefill replica"
            time.sleep(1)
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(timeout=90) == 0
    finally:
        stop_ray_server(server)


def _wait_for_metric(server: RayServer, condition, timeout: float = 15) -> None:
    """Replicas post their metrics every second: poll until `condition` holds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, server.metrics()[-3000:]
        time.sleep(0.5)


def test_a_tensor_parallel_replica(gemma3_gguf):
    """A replica split over 2 tensor-parallel ranks (its CPUs reserved by a placement group, its ranks its
    own processes) answers as the whole model does, and its ranks go with it on SIGTERM."""
    expected = (
        LLM(gemma3_gguf, num_kv_blocks=64)
        .generate(["The capital of France is"], SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)[0]
        .outputs[0]
        .text
    )
    server = RayServer("--replicas", "1", "-tp", "2", model="gemma3-270m", cpus=2)
    try:
        server.wait_ready(timeout=240, replicas=1)
        ray_client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120)
        answer = ray_client.completions.create(model="gemma3-270m", prompt="The capital of France is", max_tokens=12,
                                               temperature=0)  # fmt: skip
        assert answer.choices[0].text == expected
        [replica_pid] = server.replicas().values()
        ranks = [child.pid for child in psutil.Process(replica_pid).children(recursive=True)]
        assert len(ranks) >= 2  # the two ranks (and the spawn tracker)
        _sigterm_and_check_gone(server, ranks)
    finally:
        stop_ray_server(server)


def test_a_replica_split_over_two_nodes(gemma3_gguf):
    """`--nnodes 2` on a two-node Ray cluster (Ray's own test cluster: two raylets on this machine): the
    replica's placement group spreads its bundles over both nodes, the other node's rank runs in a
    RankHost actor there, the answer is the whole model's, and the ranks go when the server stops."""
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=1)
    server = RayServer("--replicas", "1", "-tp", "2", "--nnodes", "2", "--ray-address", cluster.address,
                       model="gemma3-270m", cpus=2)  # fmt: skip
    try:
        server.wait_ready(timeout=240, replicas=1)
        ray_client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120)
        answer = ray_client.completions.create(model="gemma3-270m", prompt="The capital of France is", max_tokens=12,
                                               temperature=0)  # fmt: skip
        expected = (
            LLM(gemma3_gguf, num_kv_blocks=64)
            .generate(["The capital of France is"], SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)[0]
            .outputs[0]
            .text
        )
        assert answer.choices[0].text == expected
        hosts = [p for p in psutil.process_iter(["cmdline"]) if "ray::RankHost" in " ".join(p.info["cmdline"] or [])]
        assert len(hosts) == 1  # node 1's share of the model
        ranks = [child.pid for child in hosts[0].children(recursive=True)]
        assert ranks
        _sigterm_and_check_gone(server, ranks)
    finally:
        stop_ray_server(server)
        cluster.shutdown()


def _sigterm_and_check_gone(server: RayServer, pids: list[int]) -> None:
    """SIGTERM the server: it exits 0 and none of `pids` (a split replica's ranks) outlives it."""
    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(timeout=90) == 0
    deadline = time.monotonic() + 30
    while any(psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie" for pid in pids):
        assert time.monotonic() < deadline, "a rank outlived its replica"
        time.sleep(0.5)
