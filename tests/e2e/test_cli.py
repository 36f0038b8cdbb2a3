"""The folio command as a user runs it."""

from __future__ import annotations

import json
import logging
import socket
import subprocess
import sys

import pytest

from folio.cli import main

KV = ["--kv-cache-memory", "128MiB"]


def test_run_streams_a_completion(smollm2_gguf, capsys, caplog):
    caplog.set_level(logging.INFO, logger="folio")
    assert (
        main(
            [
                "run",
                str(smollm2_gguf),
                "The capital of France is",
                "--raw",
                "--temperature",
                "0",
                "--max-tokens",
                "8",
                *KV,
            ]
        )
        == 0
    )
    out = capsys.readouterr()
    assert "Paris" in out.out
    assert "KV cache:" in caplog.text and "tokens" in caplog.text  # capacity reported at start-up


def test_run_with_a_format_prints_json_of_the_schema(smollm2_gguf, tmp_path, capsys):
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}, "population": {"type": "integer"}},
        "required": ["city", "population"],
        "additionalProperties": False,
    }
    schema_file = tmp_path / "city.json"
    schema_file.write_text(json.dumps(schema))
    args = ["run", str(smollm2_gguf), "Describe Paris.", "--format", str(schema_file), "--temperature", "0", *KV]
    assert main(args) == 0
    answer = json.loads(capsys.readouterr().out)
    assert set(answer) == {"city", "population"} and isinstance(answer["population"], int)
    assert main(["run", str(smollm2_gguf), "A person as JSON.", "--format", "json", "--temperature", "0", *KV]) == 0
    assert isinstance(json.loads(capsys.readouterr().out), dict)


def test_generate_jsonl(smollm2_gguf, tmp_path):
    source = tmp_path / "prompts.jsonl"
    source.write_text(
        json.dumps({"id": "a", "prompt": "1, 2, 3,", "max_tokens": 4, "temperature": 0})
        + "\n"
        + json.dumps({"id": "b", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6})
        + "\n"
    )
    target = tmp_path / "out.jsonl"
    assert main(["generate", str(smollm2_gguf), "--input", str(source), "--output", str(target), *KV]) == 0
    rows = [json.loads(line) for line in target.read_text().splitlines()]
    assert [r["id"] for r in rows] == ["a", "b"]
    assert rows[0]["completion_tokens"] == 4 and rows[0]["finish_reason"] == "length"
    assert rows[1]["completion_tokens"] <= 6 and rows[1]["text"]


def test_chat_reads_turns_from_stdin(smollm2_gguf):
    result = subprocess.run(
        [sys.executable, "-m", "folio.cli", "chat", str(smollm2_gguf), "--max-tokens", "8", "--temperature", "0", *KV],
        input="What is 2+2?\n/bye\n",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0 and result.stdout.strip()


ERROR_CASES = [
    (["run", "no-such-model", "hi"], "unknown model"),
    (["run", "/nonexistent/model.gguf", "hi"], "no such file"),
    (["generate", "smollm2-135m", "--input", "/nonexistent.jsonl", "--output", "/tmp/x.jsonl"], "does not exist"),
    (["run", "smollm2-135m", "hi", "--temperature", "-1", *KV], "temperature"),
    (["chat", "gemma3-270m", *KV], "no chat template"),
    (["run", "smollm2-135m", "hi", "--format", "{not json", *KV], "json schema"),
    (["run", "smollm2-135m", "hi", "--format", "yaml", *KV], "--format takes"),
    (["serve", "smollm2-135m", "--replicas", "2", "--lora-modules", "sql=/lora/sql"], "Ray replicas serve no LoRA"),
]


def _one_error_line(stderr: str, message: str) -> None:
    errors = [line for line in stderr.splitlines() if line.startswith("folio: error:")]
    assert len(errors) == 1 and message in errors[0], stderr
    assert "Traceback" not in stderr


def test_an_error_exits_non_zero_with_one_line_and_no_traceback(smollm2_gguf):
    """As a real process: its exit status and everything it writes to stderr."""
    args, message = ERROR_CASES[3]
    result = subprocess.run([sys.executable, "-m", "folio.cli", *args], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    _one_error_line(result.stderr, message)


@pytest.mark.parametrize(("args", "message"), ERROR_CASES)
def test_errors_are_one_line_without_traceback(args, message, smollm2_gguf, gemma3_gguf, capsys):
    """Each error through the CLI's entry point in this process (an interpreter per case would cost
    seconds of start-up each; the test above runs one as a process)."""
    assert main(args) != 0
    _one_error_line(capsys.readouterr().err, message)


def test_bad_jsonl_line_is_reported_by_number(smollm2_gguf, tmp_path, capsys):
    source = tmp_path / "bad.jsonl"
    source.write_text('{"prompt": "ok"}\nnot json\n')
    assert main(["generate", str(smollm2_gguf), "--input", str(source), "--output", str(tmp_path / "o"), *KV]) == 1
    assert "line 2" in capsys.readouterr().err


def test_serve_on_a_busy_port_is_one_line(capsys):
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        assert main(["serve", "smollm2-135m", "--port", str(port)]) == 1
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err


def test_eval_perplexity_writes_its_result(smollm2_gguf, tmp_path, capsys):
    # Short windows: bfloat16 matmuls are slow on a CPU without AVX-512 BF16 (~4 s per 256-token window here).
    args = ["eval", "perplexity", str(smollm2_gguf), "--num-tokens", "256", "--context", "128", "--dtype", "bfloat16",
            "--output-dir", str(tmp_path), *KV]  # fmt: skip
    assert main(args) == 0
    [result_file] = list(tmp_path.glob("perplexity_*_gguf_bfloat16_*.json"))
    result = json.loads(result_file.read_text())
    assert result["num_windows"] == 2 and result["num_predicted"] == 2 * 127
    assert 1 < result["perplexity"] < 100  # a trained model on English text
    assert "perplexity" in capsys.readouterr().out


def test_eval_perplexity_with_8_bit_activations_is_recorded_as_such(smollm2_gguf, tmp_path, capsys):
    args = ["eval", "perplexity", str(smollm2_gguf), "--num-tokens", "512", "--context", "256",
            "--activation-bits", "8", "--output-dir", str(tmp_path), *KV]  # fmt: skip
    assert main(args) == 0
    [result_file] = list(tmp_path.glob("perplexity_*_gguf_float32_a8_*.json"))
    result = json.loads(result_file.read_text())
    assert result["activation_bits"] == 8 and 1 < result["perplexity"] < 100
    assert "8-bit activations" in capsys.readouterr().out


def test_eval_agreement_against_the_dequantized_model(smollm2_gguf, tmp_path, capsys):
    args = ["eval", "agreement", str(smollm2_gguf), "--num-prompts", "3", "--max-tokens", "6",
            "--quantization", "none", "--output-dir", str(tmp_path), *KV]  # fmt: skip
    assert main(args) == 0
    [result_file] = list(tmp_path.glob("agreement_*_none_float32_*.json"))
    result = json.loads(result_file.read_text())
    # The same float32 weights and cache as the reference: every continuation is identical.
    assert result["identical"] == 3 and result["mean_prefix_share"] == 1.0
    assert "3/3 continuations identical" in capsys.readouterr().out


def test_prefix_share_counts_up_to_the_first_difference():
    from folio_tools.eval.agreement import prefix_share

    assert prefix_share([1, 2, 3, 4], [1, 2, 9, 4]) == 0.5
    assert prefix_share([1, 2], [1, 2]) == 1.0 and prefix_share([5], [6]) == 0.0
