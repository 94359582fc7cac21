"""`deepinfer generate` as a user runs it: a subprocess of the installed entry point."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from deepinfer import SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def run_cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    script = Path(sys.executable).with_name("deepinfer")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "deepinfer.cli.main"]
    return subprocess.run(command + list(args), capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL, env=dict(os.environ))


def assert_one_line_error(result: subprocess.CompletedProcess) -> None:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    assert len(lines) == 1, f"expected one line on stderr, got: {result.stderr!r}"
    assert not result.stdout.strip()


def test_generate_chat_prints_the_answer(engine_base_llm):
    question = "What is 2+2?"
    result = run_cli("generate", question, "--max-tokens", "8", "--temperature", "0",
                     "--seed", "1", "--dtype", "float32")
    assert result.returncode == 0, result.stderr[-2000:]
    expected = engine_base_llm.chat([{"role": "user", "content": question}],
                                    SamplingParams(temperature=0.0, max_tokens=8),
                                    use_tqdm=False)[0].outputs[0].text
    assert expected.strip() and expected.strip() in result.stdout


def test_generate_raw_is_plain_completion(engine_base_llm):
    prompt = "The capital of France is"
    result = run_cli("generate", "--raw", prompt, "--max-tokens", "8", "--temperature", "0",
                     "--dtype", "float32")
    assert result.returncode == 0, result.stderr[-2000:]
    expected = engine_base_llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8),
                                        use_tqdm=False)[0].outputs[0].text
    assert expected.strip() and expected.strip() in result.stdout


@pytest.mark.parametrize("bad_args", [
    ["--max-tokens", "-1"],
    ["--max-tokens", "0"],
    ["--max-tokens", "many"],
    ["--temperature", "abc"],
    ["--temperature", "-0.5"],
    ["--seed", "x"],
    ["--dtype", "float8"],
], ids=lambda a: " ".join(a))
def test_bad_arguments_exit_2_with_one_line(bad_args):
    assert_one_line_error(run_cli("generate", "hello", *bad_args, timeout=120))


def test_missing_prompt_exits_2():
    assert_one_line_error(run_cli("generate", timeout=120))


def test_nonexistent_model_exits_2():
    assert_one_line_error(run_cli("generate", "--model", "/nonexistent.gguf", "hello",
                                  timeout=120))


def test_unreadable_model_file_exits_2(tmp_path):
    bogus = tmp_path / "broken.gguf"
    bogus.write_bytes(b"this is not a gguf file" * 64)
    assert_one_line_error(run_cli("generate", "--model", str(bogus), "hello", timeout=120))
