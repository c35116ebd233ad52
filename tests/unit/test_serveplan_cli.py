"""`bwstack serve-plan`: bad input gets one line and exit 2 before anything runs; the reference configs are listed
with their sources; the probe zipapp carries the node side and the configs."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile

import pytest
from helpers import REAL_LOCK, bwstack

from bwstack.cli.main import main
from bwstack.fleet import probe_bundle
from bwstack.probe.serveplan import references

REFERENCES = {
    "llama-3.1-8b-instruct": "meta-llama/Llama-3.1-8B-Instruct",
    "qwen3-30b-a3b": "Qwen/Qwen3-30B-A3B",
    "deepseek-v3": "deepseek-ai/DeepSeek-V3",
    "gpt-oss-20b": "openai/gpt-oss-20b",
    "llama-3.1-8b-instruct-nvfp4": "nvidia/Llama-3.1-8B-Instruct-FP4",
    "sglang-eagle3-llama-3.1-8b-instruct": "lmsys/sglang-EAGLE3-LLaMA3.1-Instruct-8B",
}


@pytest.fixture
def fake_env(tmp_path):
    """A directory that looks like an env to the argument checks (bad input is refused before it is used)."""
    env = tmp_path / "env"
    (env / "bin").mkdir(parents=True)
    (env / "bin" / "python").symlink_to(sys.executable)
    return env


BAD = [
    ("capability-word", ["--model", "gpt-oss-20b", "--capability", "banana"], "--capability 'banana': expected"),
    ("capability-three-parts", ["--model", "gpt-oss-20b", "--capability", "12.0.1"], "--capability '12.0.1'"),
    ("capability-empty", ["--model", "gpt-oss-20b", "--capability", ""], "--capability '': expected"),
    ("no-model", [], "--model is required"),
    ("model-empty", ["--model", ""], "--model: empty value"),
    ("model-unknown", ["--model", "llama-9"], "--model llama-9: neither a reference config"),
    ("model-dir-without-config", ["--model", "/"], "--model /: neither a reference config"),
    ("draft-without-algorithm", ["--model", "llama-3.1-8b-instruct", "--draft", "gpt-oss-20b"], "--draft needs"),
    ("tp-zero", ["--model", "gpt-oss-20b", "--tp", "0"], "--tp 0: expected a tensor parallel size"),
    ("backend-not-a-name", ["--model", "gpt-oss-20b", "--attention-backend", "tri ton"], "--attention-backend"),
    ("profile-unknown", ["--model", "gpt-oss-20b", "--profile", "cu99"], "unknown profile 'cu99'"),
]  # fmt: skip


@pytest.mark.parametrize(("case", "args", "expected"), BAD, ids=[c[0] for c in BAD])
def test_bad_input_is_one_line_and_exit_2(case, args, expected, fake_env, capsys):
    rc = main(["--lock", str(REAL_LOCK), "serve-plan", "--env", str(fake_env), *args])
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert err.count("\n") == 0 and err.startswith("bwstack: error: ")
    assert expected in err


def test_a_path_that_is_not_an_env_is_refused(tmp_path, capsys):
    rc = main(["--lock", str(REAL_LOCK), "serve-plan", "--env", str(tmp_path), "--model", "gpt-oss-20b"])
    assert rc == 2 and "not a Python env (no bin/python)" in capsys.readouterr().err


def test_bad_input_prints_no_traceback_from_the_real_cli(fake_env):
    result = bwstack("serve-plan", "--env", str(fake_env), "--model", "gpt-oss-20b", "--capability", "banana")
    assert result.returncode == 2 and "Traceback" not in result.stderr and result.stderr.count("\n") == 1


def test_the_reference_configs_are_listed_with_their_sources(capsys):
    assert main(["serve-plan", "--list-models", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert {name: src["repo"] for name, src in listed.items()} == REFERENCES
    for name, src in listed.items():
        assert all(url.startswith(f"https://huggingface.co/{src['repo']}/") for url in src["files"].values()), name
        assert set(src["files"]) == set(references.files(name)), name


def test_each_reference_config_names_the_architecture_sglang_resolves():
    architectures = {name: json.loads(references.files(name)["config.json"])["architectures"][0] for name in REFERENCES}
    assert architectures == {
        "llama-3.1-8b-instruct": "LlamaForCausalLM",
        "qwen3-30b-a3b": "Qwen3MoeForCausalLM",
        "deepseek-v3": "DeepseekV3ForCausalLM",
        "gpt-oss-20b": "GptOssForCausalLM",
        "llama-3.1-8b-instruct-nvfp4": "LlamaForCausalLM",
        "sglang-eagle3-llama-3.1-8b-instruct": "LlamaForCausalLMEagle3",
    }
    nvfp4 = json.loads(references.files("llama-3.1-8b-instruct-nvfp4")["hf_quant_config.json"])
    assert nvfp4["quantization"]["quant_algo"] == "NVFP4"
    deepseek = json.loads(references.files("deepseek-v3")["config.json"])["quantization_config"]
    assert deepseek["quant_method"] == "fp8" and deepseek["weight_block_size"] == [128, 128]


def test_the_probe_zipapp_carries_the_node_side_and_the_reference_configs(tmp_path):
    bundle = probe_bundle.write(tmp_path / "probe.pyz")
    names = set(zipfile.ZipFile(bundle).namelist())
    want = {f"bwstack/probe/{name}.py" for name in ("serveplan/node", "serveplan/references", "scripts/serveplan")}
    assert want <= names
    assert not {n for n in names if n.startswith("bwstack/serveplan/")}  # the controller side stays home
    code = "from bwstack.probe.serveplan import references; print(','.join(references.reference_names()))"
    out = subprocess.run(
        [sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, {str(bundle)!r}); {code}"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert out.split(",") == sorted(REFERENCES)
