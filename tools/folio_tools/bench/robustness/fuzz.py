"""`folio bench fuzz`: schemathesis against a real folio server, from the server's own OpenAPI schema.

Every operation gets requests that fit the schema (positive) and requests that break it (negative),
sent one at a time; and a share of the cases are hostile shapes schemathesis never writes (deep nesting,
huge lists, lone surrogates, NaN: fuzz_hostile.py) at every POST route. The bar: every answer is 2xx or
4xx (a hostile shape 4xx), every 4xx is in its API's error format (OpenAI's, Ollama's or Anthropic's),
no stream carries a server error, and at the end the server is alive and holds nothing (admission,
running, waiting and KV cache all zero). Failures are kept as samples (request and answer, cut short).
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from tqdm import tqdm

from folio_tools.bench.robustness.hostile import HostileCase, hostile_cases
from folio_tools.bench.robustness.run import RobustnessRun, stream_error

if TYPE_CHECKING:
    import requests
    from schemathesis import GenerationMode

POST_WEIGHT = 10  # generation endpoints take most cases: their bodies are where the parameters are
HOSTILE_SHARE = 0.3  # of the cases: hostile shapes (fuzz_hostile.py), spread over every POST route


@dataclass(kw_only=True)
class FuzzReport(RobustnessRun):
    base_url: str
    by_operation: dict[str, dict[str, int]] = field(default_factory=dict)  # "POST /v1/completions" -> status -> n
    by_shape: dict[str, dict[str, int]] = field(default_factory=dict)  # hostile shape -> status -> n

    def record_case(self, operation: str, status: str, problem: str | None, body: str | None, answer: str) -> None:
        per_operation = self.by_operation.setdefault(operation, {})
        per_operation[status] = per_operation.get(status, 0) + 1
        sample = {"operation": operation, "problem": problem, "answer": answer[:2000],
                  "body": body[:2000] if body is not None else None}  # fmt: skip
        self.record(status, problem, sample)


def _error_message(path: str, body: Any) -> Any:
    """The message of an error body in the format of the API `path` belongs to (KeyError/TypeError if
    the body is not in that format)."""
    if path.startswith("/api/"):  # Ollama: {"error": "..."}
        return body["error"]
    if path.startswith("/v1/messages"):  # Anthropic: {"type": "error", "error": {"type", "message"}}
        if body["type"] != "error":
            raise KeyError("type")
        return body["error"]["message"]
    return body["error"]["message"]  # OpenAI


def _ndjson_error(text: str) -> str | None:
    """An Ollama stream's error line, or None."""
    for line in text.splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            return f"a line that is not JSON: {line[:200]}"
        if isinstance(event, dict) and "error" in event:
            return str(event["error"])
    return None


def _problem(response: requests.Response) -> str | None:
    """What is wrong with an answer, or None."""
    path = urlsplit(response.request.url or "").path
    if response.status_code >= 500:
        return f"status {response.status_code}"
    if response.status_code >= 400 and response.request.method == "HEAD":
        return None  # an answer to HEAD has no body (HTTP): its status is all it says
    if response.status_code >= 400:
        try:
            if not isinstance(_error_message(path, response.json()), str):
                return "a 4xx without an error message"
        except (ValueError, KeyError, TypeError, AttributeError):
            return "a 4xx that is not in its API's error format"
        return None
    content_type = response.headers.get("content-type", "")
    if "text/event-stream" in content_type and (error := stream_error(response.text)) is not None:
        return f"a stream that ended with an error: {error.get('message')}"  # even a 4xx belonged before the 200
    if "application/x-ndjson" in content_type and (message := _ndjson_error(response.text)) is not None:
        return f"a stream that ended with an error: {message}"
    return None


def _body(case: Any) -> str | None:
    body = getattr(case, "body", None)
    return json.dumps(body, default=repr) if body is not None else None


def _runs(operations: list[Any]) -> list[tuple[Any, GenerationMode, int]]:
    """(operation, mode, weight), lightest first: POST operations weigh POST_WEIGHT times a GET's, and the
    cases a light run could not use (a GET without inputs has one case) go to the runs after it."""
    from schemathesis import GenerationMode  # heavy to import, as are the others here: only when fuzzing

    runs = [
        (op, mode, POST_WEIGHT if op.method.upper() == "POST" else 1) for op in operations for mode in GenerationMode
    ]
    return sorted(runs, key=lambda run: run[2])


def _served_schema(base_url: str) -> dict[str, Any]:
    """The server's OpenAPI schema with `model` pinned to the model it serves: any other name is a 404
    before the parameters are even read, and the point is to reach them."""
    import requests

    schema = requests.get(f"{base_url}/openapi.json", timeout=30).json()
    served = requests.get(f"{base_url}/v1/models", timeout=30).json()["data"][0]["id"]
    for component in schema.get("components", {}).get("schemas", {}).values():
        if "model" in component.get("properties", {}):
            component["properties"]["model"] = {"type": "string", "enum": [served]}
    return schema


def run_fuzz(
    base_url: str, num_cases: int, seed: int = 0, request_timeout: float = 300.0, hostile_share: float = HOSTILE_SHARE
) -> FuzzReport:
    """About `num_cases` requests (the last operation may find fewer distinct ones than it was given):
    `hostile_share` of them hostile shapes (fuzz_hostile.py), the rest schemathesis's."""
    import requests
    import schemathesis

    started = time.monotonic()
    report = FuzzReport(base_url=base_url)
    served = _served_schema(base_url)
    schema = schemathesis.openapi.from_dict(served)
    operations = [result.ok() for result in schema.get_all_operations()]
    runs = _runs(operations)
    weight_left = sum(weight for *_, weight in runs)
    hostile = hostile_cases(served, round(num_cases * hostile_share), seed, _served_model(served))
    # disable=None: a bar on a terminal, silence in logs and tests.
    with requests.Session() as session, tqdm(total=num_cases, unit="case", disable=None) as bar:
        for operation, mode, weight in runs if len(hostile) < num_cases else ():
            count = max(1, (num_cases - len(hostile) - report.requests) * weight // weight_left)
            weight_left -= weight
            bar.set_postfix_str(f"{operation.method.upper()} {operation.path} ({mode.value})")
            _fuzz_operation(operation, mode, count, seed, report, session, request_timeout, bar)
        bar.set_postfix_str("hostile shapes")
        for case in hostile:
            _send_hostile(case, report, session, request_timeout)
            bar.update()
    report.settle(base_url)
    report.elapsed_s = round(time.monotonic() - started, 1)
    return report


def _served_model(schema: dict[str, Any]) -> str:
    """The model name `_served_schema` pinned."""
    for component in schema.get("components", {}).get("schemas", {}).values():
        if "enum" in component.get("properties", {}).get("model", {}):
            return component["properties"]["model"]["enum"][0]
    return ""


def _send_hostile(case: HostileCase, report: FuzzReport, session: requests.Session, timeout: float) -> None:
    import requests

    name = f"POST {case.path}"
    try:
        response = session.post(report.base_url + case.path, data=case.body, timeout=timeout,
                                headers={"content-type": "application/json"})  # fmt: skip
    except requests.RequestException as exc:
        status, problem, answer = "no answer", f"no answer: {type(exc).__name__}", str(exc)
    else:
        status, problem, answer = str(response.status_code), _problem(response), response.text
        if problem is None and case.refused and response.ok:
            problem = f"a body with {case.shape} was accepted"
    per_shape = report.by_shape.setdefault(case.shape, {})
    per_shape[status] = per_shape.get(status, 0) + 1
    report.record_case(name, status, problem, case.body[:2000].decode(errors="replace"), answer)


def _fuzz_operation(
    operation: Any, mode: GenerationMode, count: int, seed: int, report: FuzzReport, session: requests.Session,
    timeout: float, bar: tqdm,
) -> None:  # fmt: skip
    import hypothesis
    import requests
    from hypothesis import HealthCheck, Phase, given, settings

    name = f"{operation.method.upper()} {operation.path}"

    @hypothesis.seed(seed)
    @settings(max_examples=count, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(case=operation.as_strategy(generation_mode=mode))
    def send(case: Any) -> None:
        try:
            response = case.call(base_url=report.base_url, session=session, timeout=timeout)
        except requests.RequestException as exc:
            report.record_case(name, "no answer", f"no answer: {type(exc).__name__}", _body(case), str(exc))
            bar.update()
            return
        report.record_case(name, str(response.status_code), _problem(response), _body(case), response.text)
        bar.update()

    # Unsatisfiable: nothing of this mode can be made for this operation (e.g. breaking a GET without inputs).
    with contextlib.suppress(hypothesis.errors.Unsatisfiable):
        send()
