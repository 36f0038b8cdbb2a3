"""The playground (/) and the dashboard (/dashboard) in a real browser: headless Chromium (Debian's,
driven by Playwright) against a real `folio serve` of two models with an API key.

One server and one browser for the file; each test opens its own browser context (so its own session
storage, where the page keeps the key) and logs in through the page's form. Screenshots of both pages at
desktop and phone width are saved under test-artifacts/web/ (not committed).
"""

from __future__ import annotations

import json
import re
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import pytest
from playwright.sync_api import Browser, Page, sync_playwright

from tests.api.server_runner import MODEL, ServeProcess
from tests.browser.chromium import chromium_path

GEMMA = "gemma3-270m"
KEY = "browser-test-key"
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "web"
DESKTOP = {"width": 1280, "height": 800}
PHONE = {"width": 390, "height": 844}
# Model output that would run script if it were rendered as HTML, forced out of the model by a regex.
HOSTILE = '<script>window.pwned=1</script><img src=x onerror="window.pwned=2"> [click](javascript:window.pwned=3)'


class Served(ServeProcess):
    def __init__(self) -> None:
        super().__init__(MODEL, GEMMA, "--api-key", KEY, "--keep-alive", "10m", "--num-kv-blocks", "128",
                         "--reasoning-parser", "think")  # fmt: skip

    def get(self, path: str) -> httpx.Response:
        return httpx.get(f"{self.url}{path}", headers={"Authorization": f"Bearer {KEY}"}, timeout=30)

    def aborted(self) -> float:
        """Requests that ended aborted, all models together, from /metrics."""
        total = 0.0
        for line in self.get("/metrics").text.splitlines():
            if line.startswith("folio:request_success_total{") and 'finished_reason="abort"' in line:
                total += float(line.rsplit(" ", 1)[1])
        return total


@pytest.fixture(scope="module")
def served(smollm2_gguf, gemma3_gguf) -> Iterator[Served]:
    server = Served()
    try:
        server.wait_ready(timeout=120)
        yield server
    finally:
        server.process.send_signal(signal.SIGTERM)
        try:
            server.process.wait(60)
        finally:
            if server.process.poll() is None:
                server.process.kill()


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    executable = chromium_path()
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=executable, args=["--no-sandbox"])
        yield launched
        launched.close()


class Tab:
    """A page in a browser context of its own, recording what the console and page errors say."""

    def __init__(self, browser: Browser, url: str, viewport: dict = DESKTOP) -> None:
        self.context = browser.new_context(viewport=viewport)
        self.page: Page = self.context.new_page()
        self.problems: list[str] = []
        self.page.on("pageerror", lambda error: self.problems.append(f"page error: {error}"))
        self.page.on("console", self._console)
        self.page.goto(url)

    def _console(self, message) -> None:
        # Failed requests (the login probe's 401, a 400 the page shows) are the tests' to check; a refused
        # script or style (CSP) or any other error is not expected.
        if message.type == "error" and not message.text.startswith("Failed to load resource"):
            self.problems.append(f"console: {message.text}")

    def log_in(self, key: str = KEY) -> None:
        self.page.wait_for_selector("#login:not([hidden])")
        self.page.fill("#api-key", key)
        self.page.click("#login button[type=submit]")

    def close(self) -> None:
        self.context.close()
        assert not self.problems, self.problems


@pytest.fixture(autouse=True)
def _server_log_on_failure(request, served) -> Iterator[None]:
    yield
    report = getattr(request.node, "report_call", None)
    if report is not None and report.failed:
        print(f"the server's log, last lines:\n{served.output()[-4000:]}")  # shown with the failure


@pytest.fixture
def playground(browser, served) -> Iterator[Tab]:
    tab = Tab(browser, f"{served.url}/")
    tab.log_in()
    tab.page.wait_for_selector("#login", state="hidden")
    tab.page.wait_for_selector(f"#model option[value='{MODEL}']", state="attached")
    yield tab
    tab.close()


def settings(page: Page, **values: str) -> None:
    for field, value in values.items():
        page.fill(f"#{field.replace('_', '-')}", value)


def ask(page: Page, text: str, timeout: float = 120) -> str:
    """Sends `text` and waits for the whole answer; its text as shown."""
    answers = page.locator("li.message.assistant").count()
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")
    done = page.locator("li.message.assistant").nth(answers)
    done.and_(page.locator("[data-state=done]")).wait_for(timeout=timeout * 1000)
    return done.locator(".content").inner_text()


def figure(page: Page, name: str) -> str:
    return page.locator(f"li.message.assistant >> nth=-1 >> [data-figure={name}]").inner_text().split(": ", 1)[1]


def test_the_page_asks_for_the_key_and_streams_the_answer_as_it_comes(browser, served):
    assert served.get("/").status_code == 200 and httpx.get(f"{served.url}/v1/models").status_code == 401
    tab = Tab(browser, f"{served.url}/")
    page = tab.page
    tab.log_in("not-the-key")
    page.wait_for_selector("text=That key was not accepted")
    tab.log_in()
    page.wait_for_selector("#login", state="hidden")
    page.wait_for_selector(f"#model option[value='{GEMMA}']", state="attached")
    assert page.eval_on_selector_all("#model option", "options => options.map(o => o.value)") == [MODEL, GEMMA]

    settings(page, max_tokens="120", temperature="0")
    page.fill("#prompt", "Write a short story about a lighthouse keeper.")
    page.press("#prompt", "Enter")
    streaming = page.locator("li.message.assistant[data-state=streaming] .content")
    streaming.filter(has_text=re.compile(r"\S \S")).wait_for(timeout=120_000)
    partial = streaming.inner_text()
    page.locator("li.message.assistant[data-state=done]").wait_for(timeout=120_000)
    final = page.locator("li.message.assistant .content").inner_text()
    assert partial and len(final) > len(partial) and final.startswith(partial[:20]), (partial, final)
    assert figure(page, "finish") == "length" and figure(page, "tokens") == "120"
    assert float(figure(page, "ttft").removesuffix(" ms")) > 0 and float(figure(page, "tps")) > 0
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=ARTIFACTS / "playground-desktop.png")
    page.set_viewport_size(PHONE)
    page.screenshot(path=ARTIFACTS / "playground-phone.png")
    tab.close()


def test_stop_ends_the_request_on_the_server(playground, served):
    page = playground.page
    before = served.aborted()
    settings(page, max_tokens="1000", temperature="0.8")
    page.fill("#prompt", "List every country in the world with its capital.")
    page.press("#prompt", "Enter")
    streaming = page.locator("li.message.assistant[data-state=streaming] .content")
    streaming.filter(has_text=re.compile(r"\S")).wait_for(timeout=120_000)
    page.click("#stop")
    page.locator("li.message.assistant[data-state=stopped]").wait_for(timeout=10_000)
    assert page.locator("#send").is_visible()
    deadline = time.monotonic() + 15
    while served.aborted() < before + 1:
        assert time.monotonic() < deadline, "the stopped request was not counted as aborted in /metrics"
        time.sleep(0.2)


def test_temperature_zero_answers_the_same_twice_and_the_second_hits_the_prefix_cache(playground):
    page = playground.page
    settings(page, max_tokens="24", temperature="0")
    first = ask(page, "Name three primary colors.")
    page.click("li.message.assistant >> nth=-1 >> button.regenerate")
    page.locator("li.message.assistant[data-state=done]").wait_for(timeout=120_000)
    second = page.locator("li.message.assistant .content").inner_text()
    assert second == first
    assert int(figure(page, "cached")) >= 16  # the same prompt again: its full blocks came from the cache


def test_copy_export_and_conversations_kept_across_a_reload(playground):
    page = playground.page
    playground.context.grant_permissions(["clipboard-read", "clipboard-write"])
    settings(page, max_tokens="12", temperature="0")
    answer = ask(page, "Say hello.")
    page.click("li.message.assistant >> nth=-1 >> button.copy")
    copied = page.evaluate("navigator.clipboard.readText()")
    page.click("#new-chat")
    ask(page, "Say goodbye.")
    page.reload()
    assert page.locator("#conversations li").count() == 2
    page.locator("#conversations li button.open", has_text="Say hello.").click()
    assert page.locator("li.message.assistant .content").inner_text() == answer
    with page.expect_download() as download:
        page.click("#export")
    exported = json.loads(Path(download.value.path()).read_text())["conversations"]
    assert [c["messages"][0]["content"] for c in exported] == ["Say goodbye.", "Say hello."]
    assert exported[1]["messages"][1]["content"] == copied and copied.strip()  # the answer as the model wrote it
    assert exported[1]["messages"][1]["figures"]["finishReason"] in ("stop", "length")


def test_a_json_schema_answer_is_valid_json(playground):
    page = playground.page
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
              "age": {"type": "integer"}}, "required": ["name", "age"], "additionalProperties": False}  # fmt: skip
    page.select_option("#constraint-kind", "json_schema")
    page.fill("#constraint", json.dumps(schema))
    settings(page, max_tokens="80", temperature="0")
    jsonschema.validate(json.loads(ask(page, "Describe a person.")), schema)
    assert figure(page, "finish") == "stop"


def test_model_output_that_looks_like_html_is_shown_as_text_and_runs_nothing(playground):
    page = playground.page
    regex = "".join("\\" + c if c in r"\.^$|?*+()[]{}" else c for c in HOSTILE)
    page.select_option("#constraint-kind", "regex")
    page.fill("#constraint", regex)
    settings(page, max_tokens="100", temperature="0")
    shown = ask(page, "Say something.")
    assert shown == HOSTILE
    content = page.locator("li.message.assistant >> nth=-1 >> .content")
    assert content.locator("script, img, iframe, [onerror]").count() == 0
    assert content.locator("a").count() == 0  # the javascript: link is text, not a link
    page.get_by_text("[click](javascript:window.pwned=3)").click()
    page.wait_for_timeout(300)
    assert page.evaluate("window.pwned") is None


def test_reasoning_is_folded_away_and_tool_calls_are_cards(playground):
    page = playground.page
    page.select_option("#constraint-kind", "regex")  # SmolLM2 does not think: a regex makes it
    page.fill("#constraint", r"<think>[a-z ]{10,40}</think>\n\n[A-Z][a-z ]{5,30}\.")
    settings(page, max_tokens="60", temperature="0")
    answer = ask(page, "Is the sky blue?")
    reasoning = page.locator("li.message.assistant >> nth=-1 >> details.reasoning")
    assert reasoning.count() == 1 and reasoning.get_attribute("open") is None  # folded
    assert "<think>" not in answer and answer.endswith(".")
    assert page.locator("li.message.assistant >> nth=-1 >> details.reasoning .text").text_content()  # hidden, there

    page.select_option("#constraint-kind", "")
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
               "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}}}  # fmt: skip
    page.fill("#tools", json.dumps([weather]))
    page.select_option("#tool-choice", "required")
    ask(page, "What is the weather in Paris?")
    card = page.locator("li.message.assistant >> nth=-1 >> .tool-call")
    assert card.locator(".name").inner_text() == "get_weather()"
    assert set(json.loads(card.locator("pre").inner_text())) == {"city"}
    assert figure(page, "finish") == "tool_calls"


def test_the_model_picker_switches_models_and_a_refusal_is_shown(playground, served):
    page = playground.page
    page.select_option("#model", GEMMA)
    settings(page, max_tokens="8", temperature="0")
    page.fill("#prompt", "Hello!")
    page.press("#prompt", "Enter")  # Gemma 3 270M is a base model: no chat template, so chat is refused
    page.wait_for_selector("#error:has-text('no chat template')", timeout=180_000)
    assert page.locator("li.message.assistant").count() == 0  # no empty answer left behind
    page.select_option("#mode", "raw")
    assert ask(page, "The capital of France is")
    assert page.locator("li.message.assistant >> nth=-1 >> .who").inner_text().lower() == GEMMA
    page.reload()  # the choices are remembered
    page.wait_for_selector(f"#model option[value='{GEMMA}']", state="attached")
    assert page.input_value("#model") == GEMMA and page.input_value("#mode") == "raw"
    listed = {m["id"]: m["status"]["value"] for m in served.get("/v1/models").json()["data"]}
    assert listed[GEMMA] == "loaded"


def test_the_dashboard_charts_move_while_requests_run(browser, served):
    tab = Tab(browser, f"{served.url}/dashboard")
    tab.log_in()
    page = tab.page
    page.wait_for_selector("#login", state="hidden")
    stop = threading.Event()

    def load() -> None:
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 48, "temperature": 0.8}
        while not stop.is_set():
            httpx.post(f"{served.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                       timeout=60)  # fmt: skip

    worker = threading.Thread(target=load)
    worker.start()
    try:
        page.wait_for_function(
            "() => Number(document.querySelector('#chart-throughput')?.dataset.max) > 0"
            " && Number(document.querySelector('#stat-output-tps')?.dataset.value) > 0",
            timeout=60_000,
        )
        page.wait_for_function("() => Number(document.querySelector('#stat-ttft-p50')?.dataset.value) > 0",
                               timeout=30_000)  # fmt: skip
        points = int(page.get_attribute("#chart-throughput", "data-points") or 0)
        page.wait_for_function(f"() => Number(document.querySelector('#chart-throughput').dataset.points) > {points}",
                               timeout=10_000)  # fmt: skip
    finally:
        stop.set()
        worker.join()
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=ARTIFACTS / "dashboard-desktop.png", full_page=True)
    page.set_viewport_size(PHONE)
    page.wait_for_timeout(1500)  # a poll, and the charts resized to the narrow page
    page.screenshot(path=ARTIFACTS / "dashboard-phone.png", full_page=True)
    tab.close()


def test_pages_carry_a_strict_content_security_policy_and_unknown_assets_are_404(served):
    for path in ("/", "/dashboard", "/ui/playground.js", "/ui/dashboard.css"):
        response = httpx.get(f"{served.url}{path}")
        assert response.status_code == 200, path
        policy = response.headers["content-security-policy"]
        assert "script-src 'self'" in policy and "default-src 'none'" in policy and "unsafe" not in policy
        assert response.headers["x-content-type-options"] == "nosniff"
    assert httpx.get(f"{served.url}/ui/build.json").status_code == 404
    assert httpx.get(f"{served.url}/ui/..%2F..%2Fapp.py").status_code == 404
