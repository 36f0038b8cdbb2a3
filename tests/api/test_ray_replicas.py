"""`folio serve --replicas 2` on Ray Serve, met as a user meets it: the CLI starts a local Ray instance,
two engine replicas and the ingress; the official openai client talks to it.

One Ray instance for the shared server's tests (starting one costs ~15 s here); the last of them stops
it with SIGTERM. The tests after it start their own `folio serve`s (split replicas; one disaggregated and
autoscaled server for the disaggregation and autoscaling tests), all joined with `--ray-address` to one
Ray test cluster, which spares each its own Ray instance.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
import warnings

import anthropic
import httpx
import ollama
import openai
import psutil
import pytest

from folio import LLM, SamplingParams
from tests.api.ray_server import (
    KEY,
    RayServer,
    StreamOnThread,
    bound_sockets,
    completion_texts,
    is_loopback,
    ray_test_cluster,
    routed_delta,
    shutdown_serve,
    sigterm_and_check_gone,
    stop_ray_server,
    wait_for_metric,
    wait_until_computing,
)
from tests.api.server_runner import MODEL, free_port
from tests.api.tool_examples import HISTORY as TOOL_HISTORY
from tests.api.tool_examples import TOOLS
from tests.tiny_models import make_tiny_model

TINY_PROMPT = "t5 t17 t42 t8 t99 t3"
TENANT_A = "You are the support assistant of a bakery. Answer in one short sentence about bread. " * 4
TENANT_B = "You are a travel agent who only talks about trains across the Alps and their timetables. " * 4


@pytest.fixture(scope="module")
def ray_server():
    # RAY_ADDRESS names another cluster: `folio serve --replicas` starts its own Ray all the same.
    server = RayServer(environment={"RAY_ADDRESS": "203.0.113.9:6379"})
    try:
        server.wait_ready(timeout=240)
        yield server
    finally:
        stop_ray_server(server)


@pytest.fixture(scope="module")
def ray_client(ray_server):
    return openai.OpenAI(base_url=f"{ray_server.url}/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def ray_cluster():
    """Ray's own test cluster, for the tests after the shared server stopped (its SIGTERM test finds no
    raylet left)."""
    with ray_test_cluster() as cluster:
        yield cluster


@pytest.fixture
def joined(ray_cluster):
    """The cluster's address, for one test's `folio serve --ray-address`."""
    yield ray_cluster.address
    shutdown_serve()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    """A tiny random gemma3 (4 query heads over 2 KV heads: it splits over 2 ranks) for the split-replica
    tests, which compare a split replica with the whole model, not with the catalog model: it loads in a
    blink, where a catalog GGUF takes each rank seconds to unpack."""
    return str(make_tiny_model("gemma3", tmp_path_factory.mktemp("ray-tiny") / "gemma3"))


@pytest.fixture(scope="module")
def tiny_expected(tiny_model) -> str:
    """The whole tiny model's greedy answer, in this process: what a split replica must answer."""
    params = SamplingParams(max_tokens=12, temperature=0)
    return LLM(tiny_model, num_kv_blocks=64).generate([TINY_PROMPT], params, use_tqdm=False)[0].outputs[0].text


@pytest.fixture(scope="module")
def disaggregated(ray_cluster):
    """`--disaggregate` with autoscaled decode replicas (1 to 2, one request in flight each): the server of
    the last two tests, which the last one stops."""
    server = RayServer("--disaggregate", "--prefill-replicas", "1", "--min-replicas", "1", "--max-replicas", "2",
                       "--autoscale-target", "1", "--downscale-delay", "10",
                       "--ray-address", ray_cluster.address)  # fmt: skip
    try:
        server.wait_ready(timeout=240, replicas=1, role="decode")
        server.wait_ready(timeout=60, replicas=1, role="prefill")
        yield server
    finally:
        stop_ray_server(server)
        shutdown_serve()


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
        per_replica = routed_delta(before, after)
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


# Ray's processes under the server, by the names psutil reads (workers retitle themselves "ray::<what>").
RAY_PROCESSES = ("gcs_server", "raylet", "ray::DashboardAgent", "ray::RuntimeEnvAgent", "ray::ServeController",
                 "ray::ProxyActor")  # fmt: skip


def test_every_port_of_the_ray_it_started_is_on_loopback(ray_server):
    """Ray's services run whatever a client that reaches them sends (folio/scale_out/deploy.py): a port open
    on a network would make --api-key protect nothing. Every listener under the server, Ray's included."""
    server = psutil.Process(ray_server.process.pid)
    deadline = time.monotonic() + 60
    while True:  # the agents open their ports a moment after ray.init returns
        found = bound_sockets(server)
        # A worker's title carries the method it runs ("ray::ServeController.listen_for_change").
        missing = [name for name in RAY_PROCESSES if not any(key.split()[0].startswith(name) for key in found)]
        if not missing:
            break
        assert time.monotonic() < deadline, f"no listening socket yet for {missing}: {found}"
        time.sleep(0.5)
    exposed = [f"{name}: {address}" for name, addresses in found.items() for address in addresses
               if not is_loopback(address.rsplit(":", 1)[0])]  # fmt: skip
    assert not exposed, "listening beyond loopback:\n" + "\n".join(exposed)


def test_errors_auth_and_health(ray_server, ray_client):
    with pytest.raises(openai.BadRequestError) as bad:
        ray_client.completions.create(model=MODEL, prompt="x", temperature=-1)
    assert bad.value.body["param"] == "temperature"
    anonymous = httpx.post(f"{ray_server.url}/v1/completions", json={"model": MODEL, "prompt": "x"}, timeout=10)
    assert anonymous.status_code == 401 and anonymous.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{ray_server.url}/health", timeout=10).json() == {"status": "ok"}
    playground = httpx.get(f"{ray_server.url}/", timeout=10)  # the pages load without the key, and ask for it
    assert playground.status_code == 200 and "script-src 'self'" in playground.headers["content-security-policy"]
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
    placed = []
    for prompt in ("Zebras and zeppelins: a list of facts.", "Quantum quokkas, chapter one."):  # no recorded prefix
        before = ray_server.routed()
        stream = StreamOnThread(ray_client, prompt, max_tokens=160)
        stream.start()
        assert stream.started.wait(60) and not stream.failure
        placed.append((stream, next(iter(routed_delta(before, ray_server.routed())))))
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


def test_a_replica_split_over_two_nodes(ray_cluster, joined, tiny_model, tiny_expected):
    """A replica split over 2 tensor-parallel ranks, with `--nnodes 2` on a two-node Ray cluster (Ray's own
    test cluster: two raylets on this machine): the replica's placement group reserves its CPUs, a bundle
    on each node; this node's rank is a process of the replica's own, the other node's runs in a RankHost
    actor there; the answer is the whole model's, and every rank goes with the server on SIGTERM (while
    Ray, a joined cluster, runs on). A replica split on one node starts its ranks the same way, as this
    node's share here, so this one test covers both (the single-node test took a Ray server of its own)."""
    server = RayServer("--replicas", "1", "-tp", "2", "--nnodes", "2", "--ray-address", joined, model=tiny_model,
                       cpus=2)  # fmt: skip
    nodes = []
    try:
        nodes.append(ray_cluster.add_node(num_cpus=1))  # while the server starts: a 1-CPU bundle on each node
        server.wait_ready(timeout=240, replicas=1)
        ray_client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120)
        answer = ray_client.completions.create(model=tiny_model, prompt=TINY_PROMPT, max_tokens=12, temperature=0)
        assert answer.choices[0].text == tiny_expected
        [replica_pid] = server.replicas().values()
        local = [child.pid for child in psutil.Process(replica_pid).children(recursive=True)]
        assert local  # this node's rank (and the spawn tracker)
        hosts = [p for p in psutil.process_iter(["cmdline"]) if "ray::RankHost" in " ".join(p.info["cmdline"] or [])]
        assert len(hosts) == 1  # node 1's share of the model
        remote = [child.pid for child in hosts[0].children(recursive=True)]
        assert remote
        sigterm_and_check_gone(server, local + remote)
    finally:
        stop_ray_server(server)
        for node in nodes:
            ray_cluster.remove_node(node)


def test_a_server_asking_for_another_port_than_serves_proxy_refuses(joined, tiny_model):
    """Serve on a joined cluster keeps its HTTP proxy's first address (Serve itself would only log that it
    ignores the new one): `folio serve --ray-address` asking for another port exits 1 with one line that
    names the proxy's address, and deploys nothing."""
    with warnings.catch_warnings():  # Serve's own pydantic deprecations, on import
        warnings.simplefilter("ignore")
        from ray import serve
    taken = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": taken})  # as an earlier server left it
    server = RayServer("--replicas", "1", "--ray-address", joined, model=tiny_model)
    try:
        assert server.process.wait(timeout=120) == 1
        output = server.output()
    finally:
        stop_ray_server(server)
    assert f"folio: error: Ray Serve already runs on this cluster with its HTTP proxy on 127.0.0.1:{taken}" in output
    assert "Traceback" not in output
    assert serve.status().applications == {}


def test_disaggregated_prefill_and_decode(disaggregated, client):
    """--disaggregate: a prefill replica computes each prompt and hands its KV blocks to the decode
    replica. The answers are folio serve's (greedy and seeded), the blocks crossed, both pools end empty,
    and a prefill replica killed mid-prompt costs only time: the decode replica computes it itself."""
    server = disaggregated
    ray_client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=300)
    for prompt in (TENANT_A + "What is rye bread?", TENANT_B + "Which pass is the highest?"):
        greedy = dict(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
        assert completion_texts(ray_client, greedy) == completion_texts(client, greedy)
    seeded = dict(model=MODEL, prompt=TENANT_A + "Tell a story.", max_tokens=16, temperature=0.9, seed=3, n=2)
    assert completion_texts(ray_client, seeded) == completion_texts(client, seeded)
    wait_for_metric(server, lambda: sum(server.per_replica("folio:kv_transfer_blocks_total").values()) >= 8)

    prefill_pid = next(iter(server.replicas("prefill").values()))
    long_prompt = "Inventory: " + ", ".join(f"crate {i} of apples" for i in range(120)) + ". Total?"
    killed = dict(model=MODEL, prompt=long_prompt, max_tokens=8, temperature=0)
    ours: list = []
    asking = threading.Thread(target=lambda: ours.append(completion_texts(ray_client, killed)))
    asking.start()
    wait_until_computing(prefill_pid)  # killed before the prompt reached it, Serve would hand it to the next one
    os.kill(prefill_pid, signal.SIGKILL)
    theirs = completion_texts(client, killed)  # folio serve's answer, while the decode replica computes the prompt
    asking.join(timeout=240)
    assert ours == [theirs]
    wait_for_metric(server, lambda: sum(server.per_replica("folio:kv_transfer_fallbacks_total").values()) >= 1)
    # Nothing left allocated: every replica's pool is free once the requests are done.
    wait_for_metric(server, lambda: all(v == 0 for v in server.per_replica("folio:kv_cache_usage_ratio").values()))
    deadline = time.monotonic() + 180
    while prefill_pid in server.replicas("prefill").values() or not server.replicas("prefill"):
        assert time.monotonic() < deadline, "Ray did not replace the prefill replica"
        time.sleep(0.5)


def test_autoscaling_adds_a_replica_under_load(disaggregated):
    """Ray Serve's autoscaler, bounded by --min/--max-replicas, keeps one decode replica while idle and adds
    the second when the requests in flight exceed the target; then SIGTERM stops the server."""
    server = disaggregated
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=300)
    # The test before may have scaled it up: idle, it is back to one after the downscale delay (10 s here).
    server.wait_ready(timeout=180, replicas=1, role="decode")
    scaled = threading.Event()

    def busy() -> None:
        # Streamed, so that the load hangs up (and the server aborts it) once the replica is there; asked
        # again should it end before (Serve's autoscaler reads the load every 10 s).
        while not scaled.is_set():
            with client.completions.create(model=MODEL, prompt="Count slowly:", max_tokens=300, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True}) as stream:  # fmt: skip
                for _ in stream:
                    if scaled.is_set():
                        return

    load = [threading.Thread(target=busy) for _ in range(6)]
    for thread in load:
        thread.start()
    deadline = time.monotonic() + 120
    while len(server.replicas("decode")) < 2:
        assert time.monotonic() < deadline, f"no second replica: {server.replicas('decode')}"
        time.sleep(0.5)
    scaled.set()
    for thread in load:
        thread.join(timeout=300)
    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(timeout=90) == 0
